"""Golden invariants of the rollout engine: seeding, batch independence, step maps, stop handling, the MDPO
(RCR) and CJ-GRPO (EOSER, ASS) schedules, recorded trajectories and the cache forwards."""
import dataclasses
from functools import lru_cache

import pytest
import torch

from dare.models import load_model, tiny
from dare.rollout import Record, SamplerConfig, generate
from dare.rollout.masked import MaskedForward, build_masked_state
from dare.rollout.schedule import ass_split, eoser_gamma, even_split
from dare.rollout.state import make_prompt_batch, make_stop_ids
from tests.conftest import FIXTURES

TRAJECTORY = Record(trajectory=True)

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@lru_cache(maxsize=None)
def _tiny(family):
    return tiny(family, seed=3)


@lru_cache(maxsize=None)
def _tiny64(family):
    # The batch-independence promise is about the sampler: a row's seeds, schedule, padding and stops never depend on
    # the other rows. Float32 GEMMs of different batch shapes round differently (~1e-7), which flips near-ties (a
    # random tiny model is full of them); in float64 that rounding is ~1e-16 and vanishes when the sampler casts the
    # logits to float32, so the sampler's own independence is tested exactly (docs/samplers.md).
    return tiny(family, seed=3).double()


@lru_cache(maxsize=None)
def _fixture(name):
    return load_model(FIXTURES / name, dtype=torch.float32, mask_token_id=500)


@lru_cache(maxsize=None)
def _fixture64(name):
    return load_model(FIXTURES / name, dtype=torch.float64, mask_token_id=500)  # see _tiny64


SAMPLING = {
    "llada": SamplerConfig(gen_length=16, block_length=8, steps=16, temperature=1.0),
    "llada-dual-threshold": SamplerConfig(gen_length=16, block_length=8, temperature=0.8, cache="dual", threshold=0.05),
    "dream": SamplerConfig(gen_length=16, block_length=16, steps=8, temperature=0.7, top_p=0.9, remasking="entropy"),
    "dream-origin": SamplerConfig(gen_length=12, block_length=12, steps=6, remasking="origin"),
    "sdar": SamplerConfig(gen_length=16, block_length=4, steps_per_block=4, temperature=1.0, cache="block",
                          remasking="dynamic", threshold=0.01),
    "llada2-nocache": SamplerConfig(gen_length=12, block_length=8, steps_per_block=4, temperature=1.0, top_k=20),
}
FAMILY = {"llada": "llada", "llada-dual-threshold": "llada", "dream": "dream", "dream-origin": "dream", "sdar": "sdar",
          "llada2-nocache": "llada2"}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_same_call_same_rollout_bit_for_bit(name):
    # What resume and the RL loop rely on: the same call (batch, order, seeds, dtype, threads) repeats exactly.
    model, cfg = _tiny(FAMILY[name]), SAMPLING[name]
    full = generate(model, PROMPTS, cfg, n=2, seeds=[101, 202, 303])
    again = generate(model, PROMPTS, cfg, n=2, seeds=[101, 202, 303])
    assert torch.equal(full.sequences, again.sequences) and torch.equal(full.step_map, again.step_map)


@pytest.mark.parametrize("name", list(SAMPLING))
def test_batch_composition_never_matters_to_the_sampler(name):
    model, cfg = _tiny64(FAMILY[name]), SAMPLING[name]
    seeds = [101, 202, 303]
    full = generate(model, PROMPTS, cfg, n=2, seeds=seeds)
    # prompt 1 alone, and placed first in a different batch: its two samples are unchanged
    alone = generate(model, [PROMPTS[1]], cfg, n=2, seeds=[seeds[1]])
    moved = generate(model, [PROMPTS[1], PROMPTS[0]], cfg, n=2, seeds=[seeds[1], seeds[0]])
    for other, rows in ((alone, [0, 1]), (moved, [0, 1])):
        assert torch.equal(other.completion_ids[rows], full.completion_ids[2:4])
        assert torch.equal(other.step_map[rows], full.step_map[2:4])
    # and the seed matters (samples of one prompt differ, other seeds give other rollouts)
    assert not torch.equal(full.completion_ids[0], full.completion_ids[1])
    other_seed = generate(model, [PROMPTS[1]], cfg, n=2, seeds=[7])
    assert not torch.equal(other_seed.completion_ids, alone.completion_ids)


def test_generator_gives_reproducible_base_seed():
    model, cfg = _tiny("llada"), SAMPLING["llada"]
    a = generate(model, PROMPTS, cfg, generator=torch.Generator().manual_seed(5))
    b = generate(model, PROMPTS, cfg, generator=torch.Generator().manual_seed(5))
    c = generate(model, PROMPTS, cfg, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.sequences, b.sequences) and a.seeds == b.seeds
    assert not torch.equal(a.sequences, c.sequences)


@pytest.mark.parametrize("name", ["llada", "dream", "sdar", "llada2-nocache"])
def test_step_map_covers_every_committed_token_once_in_range(name):
    model, cfg = _tiny(FAMILY[name]), SAMPLING[name]
    r = generate(model, PROMPTS, cfg, seeds=[1, 2, 3], record=TRAJECTORY)
    assert ((r.step_map >= 0) & (r.step_map < r.num_steps[:, None])).all()
    t = r.trajectory
    for i in range(len(PROMPTS)):
        for s in range(int(r.num_steps[i])):
            before = t.states[i, s]
            after = t.states[i, s + 1] if s + 1 < int(r.num_steps[i]) else r.completion_ids[i]
            written = r.step_map[i] == s
            # replay: step s turns exactly the positions with step_map == s from mask into their final token
            assert (before[written] == model.adapter.mask_token_id).all()
            assert torch.equal(after[written], r.completion_ids[i][written])
            assert torch.equal(after[~written], before[~written])


def test_step_map_follows_the_fixed_schedule_block_by_block():
    model = _tiny("llada")
    cfg = SamplerConfig(gen_length=16, block_length=8, steps=8, temperature=1.0)
    r = generate(model, PROMPTS, cfg, seeds=[1, 2, 3])
    for row in r.step_map:
        counts = torch.bincount(row, minlength=8)
        assert counts.tolist() == [2] * 8  # 8 tokens per block over 4 steps
        assert (row[:8] < 4).all() and (row[8:] >= 4).all()  # semi-autoregressive blocks


def test_dream_time_grid_commits_nothing_on_the_first_step_when_steps_equal_tokens():
    model = _tiny("dream")
    cfg = SamplerConfig(gen_length=8, block_length=8, steps=8, remasking="maskgit_plus", block_stop=False)
    r = generate(model, [PROMPTS[0]], cfg)
    counts = torch.bincount(r.step_map[0], minlength=8).tolist()
    assert counts[0] == 0 and sum(counts) == 8 and r.nfe == 8  # int()-floored count, as the reference


def test_completion_mask_and_text_stop_at_the_first_stop_token():
    model = _fixture("llada-tiny")
    cfg = SamplerConfig(gen_length=32, block_length=8, steps=32, block_stop=False)
    base = generate(model, [PROMPTS[0]], cfg).completion_ids[0].tolist()
    pos = next(j for j in range(6, 32) if base[j] not in base[:j])
    stop = base[pos]
    r = generate(model, [PROMPTS[0]], dataclasses.replace(cfg, stop_token_ids=[stop]))
    assert r.completion_ids[0].tolist() == base  # stop ids do not change decoding without block_stop
    assert r.completion_mask[0].tolist() == [1] * (pos + 1) + [0] * (31 - pos)

    class Tok:  # decodes ids as space-separated numbers
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))
    assert r.texts(Tok()) == [" ".join(map(str, base[:pos]))]
    # block_stop finishes the row after the block holding the stop token; the completion is unchanged
    stopped = generate(model, [PROMPTS[0]], dataclasses.replace(cfg, stop_token_ids=[stop], block_stop=True))
    assert stopped.completion_ids[0, :pos + 1].tolist() == base[:pos + 1]
    assert stopped.nfe == 8 * (pos // 8 + 1) < 32
    never = (stopped.step_map[0] == -1)
    assert never.any() and (stopped.completion_ids[0][never] == model.adapter.eos_token_id).all()
    # eos_early_stop ends the row at the first step after which nothing before the stop token is masked
    early = generate(model, [PROMPTS[0]], dataclasses.replace(cfg, stop_token_ids=[stop], eos_early_stop=True))
    base_steps = generate(model, [PROMPTS[0]], cfg).step_map[0]
    assert early.completion_ids[0, :pos + 1].tolist() == base[:pos + 1]
    assert early.nfe == int(base_steps[:pos + 1].max()) + 1 <= stopped.nfe


def test_rcr_unmasked_count_equals_the_cumulative_schedule_after_every_step():
    model = _tiny("llada")
    G, steps = 16, 6
    cfg = SamplerConfig(gen_length=G, block_length=G, steps=steps, temperature=1.0, rcr=True)
    r = generate(model, PROMPTS, cfg, seeds=[4, 5, 6], record=TRAJECTORY)
    cum = even_split(torch.tensor([G]), steps)[0].cumsum(0)
    mask = model.adapter.mask_token_id
    t = r.trajectory
    for s in range(steps):
        after = t.states[:, s + 1] if s + 1 < steps else r.completion_ids
        assert ((after != mask).sum(1) == cum[s]).all()
    assert (t.states[:, 0] == mask).all() and (r.completion_ids != mask).all()
    # running confidence: every generated position carries the confidence of the fill that is still there
    assert (t.confidence[:, -1] > 0).all()
    # RCR really re-masks: some position filled at step 0 is masked again later
    assert any(((t.x0[:, 0] != mask) & (t.states[:, s] == mask)).any() for s in range(1, steps))


def test_eoser_scale_starts_at_gamma_min():
    assert float(eoser_gamma(torch.tensor(0), 7, 0.01, 1.0, "even")) == pytest.approx(0.01)
    assert float(eoser_gamma(torch.tensor(6), 7, 0.01, 1.0, "even")) == pytest.approx(1.0)
    # the ASS variant (2^(s+1) - 1) / 2^S: 1/128 of the way at step 0, all of it after the last step
    assert float(eoser_gamma(torch.tensor(0), 7, 0.01, 1.0, "ass")) == pytest.approx(0.01 + 0.99 / 128)
    assert float(eoser_gamma(torch.tensor(6), 7, 0.01, 1.0, "ass")) == pytest.approx(0.01 + 0.99 * 127 / 128)


def test_eoser_scales_the_recorded_step0_confidence_of_stop_predictions():
    model = _fixture("llada-tiny")
    base = SamplerConfig(gen_length=16, block_length=16, steps=16, block_stop=False)
    plain = generate(model, [PROMPTS[0]], base, record=TRAJECTORY).trajectory
    stop = int(plain.x0[0, 0, 3])  # a token predicted at step 0: call it the stop token
    hit = plain.x0[0, 0] == stop
    eos = generate(model, [PROMPTS[0]], dataclasses.replace(base, eoser=True, eoser_gamma_min=0.25,
                                                              stop_token_ids=[stop]), record=TRAJECTORY).trajectory
    assert torch.allclose(eos.confidence[0, 0][hit], 0.25 * plain.confidence[0, 0][hit])
    assert torch.equal(eos.confidence[0, 0][~hit], plain.confidence[0, 0][~hit])


def test_ass_schedule():
    assert ass_split(128).tolist() == [1, 2, 4, 8, 16, 32, 65]
    assert ass_split(16).tolist() == [1, 2, 4, 9]
    model = _tiny("llada")
    cfg = SamplerConfig(gen_length=16, block_length=16, schedule="ass", temperature=1.0)
    r = generate(model, PROMPTS, cfg, seeds=[1, 2, 3])
    assert r.nfe == 4
    for row in r.step_map:
        assert torch.bincount(row, minlength=4).tolist() == [1, 2, 4, 9]


def test_suppress_eos_confidence_commits_stop_predictions_last():
    model = _fixture("llada-tiny")
    base = SamplerConfig(gen_length=16, block_length=16, steps=16, block_stop=False)
    plain = generate(model, [PROMPTS[0]], base, record=TRAJECTORY)
    first = int((plain.step_map[0] == 0).nonzero()[0])  # the token committed first (one per step)
    stop = int(plain.completion_ids[0, first])
    r = generate(model, [PROMPTS[0]], dataclasses.replace(base, suppress_eos_confidence=True, stop_token_ids=[stop]),
                 record=TRAJECTORY)
    assert r.step_map[0, first] != plain.step_map[0, first]
    t = r.trajectory
    for s in range(16):
        eligible = t.states[0, s] == 500
        stop_pred = (t.x0[0, s] == stop) & eligible
        if ((r.step_map[0] == s) & stop_pred).any():  # a stop prediction wins only when nothing else is left
            assert torch.equal(stop_pred, eligible)


def _reference_llada_cfg(model, prompt, steps, gen, block, cfg_scale):
    """LLaDA's generate loop with classifier-free guidance (greedy), written out for the check."""
    x = torch.tensor([prompt + [500] * gen])
    P = len(prompt)
    prompt_index = torch.arange(x.shape[1]) < P
    spb = steps // (gen // block)
    for b in range(gen // block):
        s0, s1 = P + b * block, P + (b + 1) * block
        k = even_split((x[:, s0:s1] == 500).sum(1), spb)[0]
        for i in range(spb):
            un = x.clone()
            un[:, prompt_index] = 500
            logits, un_logits = model(torch.cat([x, un])).logits.chunk(2)
            logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            x0 = logits.argmax(-1)
            conf = logits.double().softmax(-1).gather(-1, x0[..., None])[..., 0]
            conf[:, s1:] = -float("inf")
            conf = torch.where(x == 500, conf, torch.full_like(conf, -float("inf")))
            idx = conf[0].topk(int(k[i])).indices
            x[0, idx] = x0[0, idx]
    return x[0, P:].tolist()


def test_classifier_free_guidance_matches_the_llada_loop():
    model = _fixture("llada-tiny")
    with torch.no_grad():
        ref = _reference_llada_cfg(model, PROMPTS[0], 16, 16, 8, 1.5)
    cfg = SamplerConfig(gen_length=16, block_length=8, steps=16, cfg_scale=1.5, block_stop=False)
    assert generate(model, [PROMPTS[0]], cfg).completion_ids[0].tolist() == ref
    # batched with a longer prompt (left padding) and with the dual cache's refresh step it still runs
    assert generate(model, PROMPTS, cfg).completion_ids[0].tolist() == ref
    assert generate(model, PROMPTS, dataclasses.replace(cfg, cache="dual")).completion_ids.shape == (3, 16)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("kind", ["prefix", "dual"])
def test_cached_step_right_after_refresh_equals_the_full_forward(family, kind):
    """With nothing changed since the refresh, the cached forward is exact: checks positions, padding and
    Dream's one-token shift in front of the block."""
    model = _tiny(family)
    cfg = SamplerConfig(gen_length=16, block_length=8, steps=16, cache=kind)
    batch = make_prompt_batch(PROMPTS, None, model.adapter.pad_token_id, model.device)
    st = build_masked_state(batch, cfg, model.adapter.mask_token_id, make_stop_ids([], model.adapter, model.device), None, False)
    fwd = MaskedForward(model, st, cfg)
    rows = torch.arange(3)
    P = batch.ids.shape[1]
    with torch.no_grad():
        for c0 in (P, P + 8):
            full = fwd.full(rows, c0, c0 + 8)
            assert torch.allclose(fwd.refresh(rows, c0, c0 + 8), full, atol=1e-5)
            assert torch.allclose(fwd.step(rows, c0, c0 + 8), full, atol=1e-5)


def test_selection_rules():
    from dare.rollout.selection import select_dynamic, select_factor, select_threshold, select_top
    score = torch.tensor([[0.95, 0.2, 0.91, 0.5, 0.99]])
    elig = torch.tensor([[True, True, True, True, False]])
    assert select_top(score, elig, torch.tensor([2])).tolist() == [[True, False, True, False, False]]
    assert select_top(score, elig, torch.tensor([9])).tolist() == [[True, True, True, True, False]]  # never past #masks
    assert select_threshold(score, elig, 0.9).tolist() == [[True, False, True, False, False]]
    assert select_threshold(score, elig, 0.99).tolist() == [[True, False, False, False, False]]  # always the best one
    assert select_dynamic(score, elig, 0.9, torch.tensor([2])).tolist() == [[True, False, True, False, False]]
    assert select_dynamic(score, elig, 0.9, torch.tensor([3])).tolist() == [[True, False, True, True, False]]
    # factor f=1: accept sorted c_n while c_n >= 1 - 1/(n+1): 0.95 (any), 0.91 >= 0.667, 0.5 < 0.75 -> 2 tokens
    assert select_factor(score, elig, 1.0).tolist() == [[True, False, True, False, False]]
    # the reference accepts everything when the first failure is the last eligible position
    assert select_factor(torch.tensor([[0.99, 0.98, 0.1]]), torch.ones(1, 3, dtype=torch.bool), 1.0).all()


@pytest.mark.parametrize("kwargs, family, match", [
    (dict(gen_length=30, block_length=8), "llada", "gen_length=30 must be a multiple of block_length=8"),
    (dict(gen_length=32, block_length=8, steps=30), "llada", "steps=30 must be divisible"),
    (dict(cache="prefix"), "sdar", "cache='prefix' cannot be used"),
    (dict(cache="causal"), "llada", "cache='causal' cannot be used"),  # its weights have no causal mode
    (dict(cache="block"), "dream", "cache='block' cannot be used"),  # shifted logits
    (dict(cfg_scale=1.0, cache="block"), "llada", "cfg_scale cannot be used with cache='block'"),
    (dict(editing_threshold=0.5, threshold=0.7), "llada", "editing_threshold"),
    (dict(cfg_scale=1.0, cache="block"), "sdar", "cfg_scale"),
    (dict(remasking="origin", cache="block"), "sdar", "remasking='origin'"),
    (dict(block_length=4, steps_per_block=8, cache="block"), "sdar", "steps_per_block=8 exceeds block_length=4"),
])
def test_invalid_settings_name_the_parameter(kwargs, family, match):
    with pytest.raises(ValueError, match=match):
        generate(_tiny(family), [PROMPTS[0]], SamplerConfig(**kwargs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(remasking="lowest"), "remasking='lowest'"), (dict(cache="paged"), "cache='paged'"),
    (dict(steps=4, steps_per_block=2), "only one of steps"), (dict(remasking="dynamic"), "needs a threshold"),
    (dict(threshold=1.5), "threshold"), (dict(rcr=True, threshold=0.9), "rcr"),
    (dict(editing_threshold=0.5), "needs threshold"),
])
def test_invalid_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerConfig(**kwargs)


def test_bad_prompts_are_rejected():
    model = _tiny("llada")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], SamplerConfig(gen_length=8, block_length=8))
    with pytest.raises(ValueError, match="contain the mask token id 500"):
        generate(model, [[1, 500]], SamplerConfig(gen_length=8, block_length=8))


def test_padded_tensor_prompts_equal_token_lists():
    model = _tiny("sdar")
    cfg = SamplerConfig(gen_length=8, block_length=4, steps_per_block=2, cache="block")
    ids = torch.tensor([[0, 0, 0, 0] + PROMPTS[0], PROMPTS[2]])
    mask = torch.tensor([[0] * 4 + [1] * 7, [1] * 11])
    a = generate(model, ids, cfg, attention_mask=mask)
    b = generate(model, [PROMPTS[0], PROMPTS[2]], cfg)
    assert torch.equal(a.sequences, b.sequences) and a.prompt_length == 11
    assert a.attention_mask[0].tolist() == [0] * 4 + [1] * 15


@pytest.mark.parametrize("name, cfg", [
    ("llada-tiny", SamplerConfig(gen_length=32, block_length=8, threshold=0.3, cache="dual", block_stop=False)),
    ("llada-tiny", SamplerConfig(gen_length=32, block_length=8, threshold=0.3, cache="prefix", block_stop=False)),
    ("dream-tiny", SamplerConfig(gen_length=32, block_length=16, threshold=0.3, cache="dual", remasking="maskgit_plus")),
    ("sdar-tiny", SamplerConfig(gen_length=32, block_length=8, steps_per_block=8, remasking="dynamic", threshold=0.3,
                                cache="block")),
])
def test_rows_whose_block_is_done_sit_out_without_changing_results(name, cfg):
    """Batched threshold decoding: rows finish a block after different numbers of steps and leave the cached
    forwards early; every row still equals its solo decode (float64: batch shapes must not enter through rounding)."""
    model = _fixture64(name)
    together = generate(model, PROMPTS, cfg)
    steps = together.num_steps.tolist()
    assert len(set(steps)) > 1  # the rows really progressed at different speeds
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], cfg)
        assert torch.equal(alone.completion_ids[0], together.completion_ids[i])
        assert int(alone.num_steps[0]) == steps[i]


def test_factor_decoding_commits_at_least_one_token_per_step():
    model = _fixture("llada-tiny")
    for cache in ("none", "dual"):
        cfg = SamplerConfig(gen_length=32, block_length=8, factor=1.0, cache=cache, block_stop=False)
        r = generate(model, PROMPTS, cfg)
        assert r.nfe < 32 and (r.completion_ids != 500).all()
        for row, n in zip(r.step_map, r.num_steps):
            counts = torch.bincount(row, minlength=int(n))
            assert (counts >= 1).all() and len(counts) == int(n)
