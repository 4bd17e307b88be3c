"""``Record(entropy=True)``: the rollout's per-token record of the predictive entropy each token was committed from (EGSPO's
step selection reads it). Golden check: a direct forward on the recorded state before the token's step gives the same
entropy; recording changes nothing else."""
from functools import lru_cache

import pytest
import torch

from dare.models import tiny
from dare.rollout import Record, SamplerConfig, generate

PROMPTS = [[11, 12, 13, 14], [21, 22, 23, 24]]  # one length: the block sampler's buffer columns are the sequence's
CONFIGS = {
    "llada": SamplerConfig(gen_length=8, block_length=4, steps=4, temperature=1.0, block_stop=False),
    "llada-random": SamplerConfig(gen_length=8, block_length=8, steps=4, temperature=0.9, remasking="random"),
    "dream": SamplerConfig(gen_length=8, block_length=8, steps=4, temperature=0.7, top_p=0.9, remasking="entropy"),
    "sdar": SamplerConfig(gen_length=8, block_length=4, steps_per_block=2, temperature=1.0, block_stop=False),
    "sdar-cache": SamplerConfig(gen_length=8, block_length=4, steps_per_block=2, temperature=1.0, cache="block"),
}
# (the prefix / dual caches of masked models are approximate: their steps see stale keys, so no direct forward
# reproduces their logits; the exact block cache does)
FAMILY = {"llada": "llada", "llada-random": "llada", "dream": "dream", "sdar": "sdar", "sdar-cache": "sdar"}


@lru_cache(maxsize=None)
def _model(family):
    return tiny(family, seed=3).double()  # float64: the sampler's and the direct forward's rounding agree to ~1e-12


def _entropy(logits):
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_entropy_map_is_the_entropy_of_a_direct_forward_on_the_state_before_the_step(name):
    model, cfg = _model(FAMILY[name]), CONFIGS[name]
    r = generate(model, PROMPTS, cfg, n=2, seeds=[5, 6], record=Record(trajectory=True, entropy=True))
    t, P = r.trajectory, r.prompt_length
    assert r.entropy_map.shape == r.completion_ids.shape and r.entropy_map.dtype == torch.float32
    checked = 0
    for n in range(r.completion_ids.shape[0]):
        for pos in range(r.completion_ids.shape[1]):
            s = int(r.step_map[n, pos])
            if s < 0:
                assert r.entropy_map[n, pos] == 0
                continue
            state = torch.cat([r.prompt_ids[n], t.states[n, s]])[None]  # the completion before the row's step s
            with torch.no_grad():
                logits = model.adapter.prediction_logits(model(state).logits)[0, P + pos]
            assert abs(float(r.entropy_map[n, pos]) - float(_entropy(logits))) < 1e-5, (n, pos, s)
            checked += 1
    assert checked >= r.completion_ids.numel() // 2
    assert (r.entropy_map[r.step_map >= 0] > 0).all()  # a random tiny model is never certain


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recording_entropies_changes_no_token(name):
    model, cfg = _model(FAMILY[name]), CONFIGS[name]
    plain = generate(model, PROMPTS, cfg, n=2, seeds=[5, 6])
    recorded = generate(model, PROMPTS, cfg, n=2, seeds=[5, 6], record=Record(entropy=True))
    assert plain.entropy_map is None
    assert torch.equal(plain.completion_ids, recorded.completion_ids) and torch.equal(plain.step_map, recorded.step_map)


def test_recording_entropies_rejects_samplers_that_rewrite_committed_tokens():
    model = _model("llada")
    with pytest.raises(ValueError, match="recording entropies"):
        generate(model, PROMPTS, SamplerConfig(gen_length=8, block_length=8, steps=8, rcr=True), record=Record(entropy=True))
    with pytest.raises(ValueError, match="recording entropies"):
        Record(entropy=True).check(SamplerConfig(gen_length=8, block_length=8, threshold=0.5, editing_threshold=0.9))
    with pytest.raises(ValueError, match="recording entropies"):  # pausing does not carry the map over
        generate(model, PROMPTS, SamplerConfig(gen_length=8, block_length=8, steps=8), until_step=2,
                 record=Record(entropy=True))


def test_the_removed_sampler_keys_say_what_replaced_them():
    """``record_trajectory`` / ``record_entropy`` left SamplerConfig for the method's ``record``: a recipe that still
    sets them gets that said, not "unknown key"."""
    from dare.config.core import ConfigError
    from dare.trainer.recipe import load_recipe
    for key in ("record_trajectory", "record_entropy"):
        with pytest.raises(ConfigError, match=f"'rollout.sampler.{key}' was removed: .*its `record`"):
            load_recipe("recipes/rl/mdpo.yaml", [f"rollout.sampler.{key}=true"])
