"""Inpainting hints (``generate(hints=...)``): tokens fixed in a completion before decoding (IGPO's second round).

Golden invariants: every sampler that takes hints leaves them exactly where they were given (never unmasked, re-masked,
edited or selected), never writes them (step map -1), reports them in ``hint_mask``, decodes every other position, and
spends a masked-diffusion block's transfer budget on its masked non-hint positions only. An all -1 hint canvas
decodes exactly as no hints (bit for bit), and a sampler that cannot hold fixed tokens says so.
"""
import dataclasses
from functools import lru_cache

import pytest
import torch

from dare.models import tiny
from dare.rollout import SamplerConfig, generate, resume

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]]
N_SAMPLES = 2

CONFIGS = {
    "llada": ("llada", SamplerConfig(gen_length=16, block_length=8, steps=16, temperature=1.0)),
    "llada-dual-threshold": ("llada", SamplerConfig(gen_length=16, block_length=8, temperature=0.8, cache="dual",
                                                    threshold=0.05)),
    "llada-prefix-cfg": ("llada", SamplerConfig(gen_length=16, block_length=8, steps=8, temperature=1.0,
                                                cache="prefix", cfg_scale=1.0)),
    "llada-rcr": ("llada", SamplerConfig(gen_length=16, block_length=16, steps=8, temperature=1.0, rcr=True)),
    "dream-entropy": ("dream", SamplerConfig(gen_length=16, block_length=16, steps=8, temperature=0.7, top_p=0.9,
                                             remasking="entropy")),
    "sdar-dynamic": ("sdar", SamplerConfig(gen_length=16, block_length=4, steps_per_block=4, temperature=1.0,
                                           cache="block", remasking="dynamic", threshold=0.01)),
    "llada2-editing": ("llada2_moe", SamplerConfig(gen_length=12, block_length=8, temperature=0.0, threshold=0.5,
                                               editing_threshold=0.0, max_post_steps=2)),
}


@lru_cache(maxsize=None)
def _tiny(family):
    return tiny(family, seed=3)


def _hints(rows: int, gen_length: int, seed: int = 0, density: float = 0.4) -> torch.Tensor:
    """Random hint canvases: about ``density`` of the positions hold an ordinary token (never a special id)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(40, 90, (rows, gen_length), generator=g)
    given = torch.rand(rows, gen_length, generator=g) < density
    given[0] = False  # one row without hints: it must decode as it would anyway
    return torch.where(given, tokens, torch.full_like(tokens, -1))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hints_are_never_overwritten_or_written_and_every_other_position_is_decoded(name):
    family, cfg = CONFIGS[name]
    model = _tiny(family)
    hints = _hints(len(PROMPTS) * N_SAMPLES, cfg.gen_length)
    out = generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6], hints=hints)
    given = hints >= 0
    assert torch.equal(out.hint_mask, given)
    assert torch.equal(out.completion_ids[given], hints[given])  # exactly the given tokens, where they were given
    assert bool((out.step_map[given] == -1).all())  # no step ever wrote a hint
    mask_id = model.adapter.mask_token_id
    assert not bool((out.completion_ids == mask_id).any())
    # every non-hint position before the row's stop was decoded by some step (after it: never decoded, filled)
    decoded = out.step_map >= 0
    assert bool((decoded | given | ~out.completion_mask.bool()).all())


def test_masked_block_budget_counts_only_the_masked_non_hint_positions():
    # LLaDA's even split over a block's masks: with hints, the block's transfer budget is its non-hint masks (the
    # inpainting reference's get_num_transfer_tokens over masked, non-fixed positions), so a block with m masks and
    # spb >= m steps takes exactly m steps, one token each; a block made only of hints takes no step.
    cfg = SamplerConfig(gen_length=16, block_length=8, steps=16, temperature=1.0, block_stop=False)
    model = _tiny("llada")
    hints = torch.full((2, 16), -1)
    hints[0, [1, 2, 6]] = torch.tensor([41, 42, 43])  # block 0: 5 masks; block 1: 8 masks
    hints[1, :8] = torch.arange(50, 58)  # block 0 entirely given
    out = generate(model, [PROMPTS[0]], cfg, n=2, seeds=[9], hints=hints)
    assert out.num_steps.tolist() == [5 + 8, 0 + 8]
    for r in range(2):
        written = out.step_map[r][out.step_map[r] >= 0]
        assert written.unique().numel() == written.numel()  # one token per step


def test_no_hints_and_empty_hints_decode_bit_identically():
    for name in ("llada", "sdar-dynamic", "llada2-editing"):
        family, cfg = CONFIGS[name]
        model = _tiny(family)
        plain = generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6])
        empty = generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6],
                         hints=torch.full((len(PROMPTS) * N_SAMPLES, cfg.gen_length), -1))
        assert plain.hint_mask is None and not bool(empty.hint_mask.any())
        assert torch.equal(plain.sequences, empty.sequences) and torch.equal(plain.step_map, empty.step_map)


def test_hints_change_the_decode_around_them():
    # Hints are context: the tokens decoded around them see them (a random tiny model is a function of its input).
    family, cfg = CONFIGS["llada"]
    model = _tiny(family)
    hints = _hints(4, cfg.gen_length, density=0.5)
    plain = generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6])
    hinted = generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6], hints=hints)
    free = hints < 0
    assert torch.equal(plain.completion_ids[0], hinted.completion_ids[0])  # the row without hints: unchanged
    assert not torch.equal(plain.completion_ids[1:][free[1:]], hinted.completion_ids[1:][free[1:]])


def test_a_paused_decode_keeps_its_hints_when_resumed():
    cfg = dataclasses.replace(CONFIGS["llada"][1], temperature=0.0)  # greedy: a resumed decode equals the whole one
    model = _tiny("llada")
    hints = _hints(2, cfg.gen_length, seed=4)
    partial = generate(model, [PROMPTS[0]], cfg, n=2, seeds=[7], hints=hints, until_step=3)
    assert torch.equal(partial.hint_mask, hints >= 0)
    done = resume(model, partial, cfg)
    given = hints >= 0
    assert torch.equal(done.completion_ids[given], hints[given]) and torch.equal(done.hint_mask, given)
    whole = generate(model, [PROMPTS[0]], cfg, n=2, seeds=[7], hints=hints)
    assert torch.equal(done.completion_ids, whole.completion_ids)  # uncached decoding continues exactly


def test_bad_hints_and_the_canvas_sampler_get_clear_errors():
    family, cfg = CONFIGS["llada"]
    model = _tiny(family)
    with pytest.raises(ValueError, match=r"\[4, 16\]"):
        generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6], hints=torch.full((3, 16), -1))
    bad = torch.full((4, 16), -1)
    bad[2, 3] = model.adapter.mask_token_id
    with pytest.raises(ValueError, match="row\\(s\\) \\[2\\]"):
        generate(model, PROMPTS, cfg, n=N_SAMPLES, seeds=[5, 6], hints=bad)
    gemma = tiny("diffusion_gemma", seed=3)
    canvas = SamplerConfig(gen_length=8, block_length=4, steps=8, temperature=1.0)
    with pytest.raises(ValueError, match="canvas sampler"):
        generate(gemma, [PROMPTS[0]], canvas, n=1, seeds=[1], hints=torch.full((1, 8), -1))
