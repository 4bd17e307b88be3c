"""Golden invariants of the two decoders added for issue 43, beyond the fixtures' token-for-token decodes:
RND1's linear count schedule, and Fast-dLLM v2's block decoding (sub-blocks left to right, a block's first token from
the previous block's last row, the dual cache inside a block)."""
from functools import lru_cache

import pytest
import torch

from dare.models import FAMILIES, load_model, tiny
from dare.rollout import SamplerConfig, generate
from dare.rollout.schedule import even_split, linear_split
from tests.conftest import FIXTURES

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]
FAST = dict(gen_length=64, block_length=32, steps_per_block=32, remasking="dynamic", sub_block_length=8)


def tiny_adapter(family: str):
    spec = FAMILIES[family]
    cfg = spec.tiny_config()
    return spec.adapter(cfg, cfg.get("mask_token_id", 0))


@lru_cache(maxsize=None)
def _fixture(name, dtype=torch.float32):
    return load_model(FIXTURES / name, dtype=dtype, mask_token_id=500)


def test_linear_split_is_rnd1s_rule():
    """The masks left after step j of N are the reference's ``(total_masked * ((N - j) / N)).long()`` (float32
    arithmetic: an integer tensor times a Python float), every mask is committed once, and the extra tokens of
    M % N are spread over the steps rather than put first."""
    for n in range(1, 21):
        m = torch.arange(0, 70)
        counts = linear_split(m, n)
        assert counts.shape == (70, n) and (counts >= 0).all() and torch.equal(counts.sum(1), m)
        left = m[:, None] - counts.cumsum(1)
        for j in range(1, n):
            assert torch.equal(left[:, j - 1], (m * ((n - j) / n)).long())
    assert linear_split(torch.tensor([6]), 4)[0].tolist() == [2, 1, 2, 1]
    assert even_split(torch.tensor([6]), 4)[0].tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("family", ["rnd1", "dream", "llada"])
def test_linear_schedule_commits_its_counts(family):
    """Each step of a masked model commits exactly the linear schedule's count of the block's masks (one block and
    two), with or without parallel rows."""
    model = tiny(family, seed=3)
    for gen, block, steps in ((13, 13, 4), (16, 8, 6)):
        cfg = SamplerConfig(gen_length=gen, block_length=block, steps=steps, remasking="entropy", schedule="linear",
                            block_stop=False)
        r = generate(model, PROMPTS, cfg)
        spb, blocks = steps // (gen // block), gen // block
        want = linear_split(torch.tensor([block]), spb)[0]
        for row in r.step_map:
            for b in range(blocks):
                steps_of = row[b * block:(b + 1) * block] - b * spb
                got = torch.bincount(steps_of, minlength=spb)
                assert got.tolist() == want.tolist()


@pytest.mark.parametrize("name", ["fastdllmv2-tiny", "sdar-tiny"])
@pytest.mark.parametrize("size,threshold", [(8, 0.5), (16, 0.95)])
def test_sub_blocks_decode_left_to_right(name, size, threshold):
    """With sub-blocks, every token of a block's sub-block k is written before any of sub-block k + 1 (a step commits
    only in the first sub-block that still has a mask), for shifted and unshifted block models."""
    cfg = SamplerConfig(**{**FAST, "sub_block_length": size, "gen_length": 48}, threshold=threshold, block_stop=False)
    r = generate(_fixture(name), PROMPTS[1:], cfg)
    for i, prompt in enumerate(PROMPTS[1:]):
        P = len(prompt)
        sm = r.step_map[i]
        for b0 in range(0, P + cfg.gen_length, 32):  # absolute blocks; the first holds the prompt's tail
            subs = []
            for s0 in range(b0, b0 + 32, size):
                cols = [c - P for c in range(max(s0, P), min(s0 + size, P + cfg.gen_length))]
                if cols:
                    subs.append(sm[cols])
            for a, b in zip(subs[:-1], subs[1:]):
                assert int(a.max()) < int(b.min())


def test_shifted_block_first_token_comes_alone_from_the_previous_block():
    """Fast-dLLM v2: a block whose first position is generated writes that position alone on its first step (the
    reference's next token of a finished block, or of a prompt that ends on a block boundary); a block that starts with
    the prompt's tail does not."""
    model = _fixture("fastdllmv2-tiny")
    cfg = SamplerConfig(**FAST, threshold=0.3, block_stop=False)
    for prompt in ([7] * 64, [7] * 40):
        r = generate(model, [prompt], cfg)
        P, sm = len(prompt), r.step_map[0]
        for start in range(-(-P // 32) * 32, P + cfg.gen_length, 32):
            first = sm[start - P]
            assert (sm[start - P + 1:start - P + 32] > first).all()
        if P % 32:  # the prompt's block: a threshold step from its first step, not a lone token (8 here: the whole
            # first sub-block clears the threshold)
            assert int((sm[:32 - P % 32] == 0).sum()) > 1


@pytest.mark.parametrize("name", ["fastdllmv2-tiny", "sdar-tiny"])
def test_dual_cache_without_sub_blocks_is_the_exact_cache(name):
    """Without sub-blocks the dual cache refreshes the whole block on its first step and feeds the whole block after,
    which is the exact block cache's computation: the same tokens and forwards per row (a row whose block still starts
    with a mask refreshes, a separate call in the same step)."""
    model = _fixture(name)
    for threshold in (0.5, 1.0):
        base = dict(FAST, sub_block_length=None, threshold=threshold)
        exact = generate(model, PROMPTS, SamplerConfig(**base, cache="block"))
        dual = generate(model, PROMPTS, SamplerConfig(**base, cache="dual"))
        assert torch.equal(exact.completion_ids, dual.completion_ids) and torch.equal(exact.row_nfe, dual.row_nfe)


def test_dual_cache_rows_decode_as_they_do_alone():
    """Rows in different sub-blocks run as separate forwards of the same step, so a batched row is its own decode
    (float64: the sampler's independence, not the GEMMs' batch-shape rounding; tests/rollout/test_invariants.py)."""
    model = _fixture("fastdllmv2-tiny", torch.float64)
    cfg = SamplerConfig(**FAST, threshold=0.5, cache="dual")
    batched = generate(model, PROMPTS, cfg)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], cfg)
        assert torch.equal(batched.completion_ids[i], alone.completion_ids[0])
        assert int(batched.row_nfe[i]) == int(alone.row_nfe[0])


def test_sub_block_settings_are_checked():
    with pytest.raises(ValueError, match="sub_block_length=5 must be positive and divide block_length=32"):
        SamplerConfig(block_length=32, gen_length=64, sub_block_length=5)
    with pytest.raises(ValueError, match="sub_block_length .* needs a block-diffusion model"):
        generate(tiny("llada", seed=3), PROMPTS, SamplerConfig(gen_length=16, block_length=16, sub_block_length=8))
    kinds = {f: tiny_adapter(f).cache_kinds for f in ("llada", "fast_dllm_v2", "diffusion_gemma")}
    assert kinds == {"llada": ("none", "prefix", "dual", "block"), "fast_dllm_v2": ("none", "block", "dual"),
                     "diffusion_gemma": ("none", "block")}


def test_editing_refuses_what_its_passes_cannot_hold():
    """LLaDA2.1's editing passes decide a whole block from the block's own rows: with shifted logits a cached step has
    no row for the block's first position, and it has no sub-block or in-block cache rule."""
    cfg = dict(gen_length=32, block_length=32, threshold=0.9, editing_threshold=0.5)
    with pytest.raises(ValueError, match="editing_threshold .* cannot be used with a shifted-logit model"):
        generate(_fixture("fastdllmv2-tiny"), PROMPTS[:1], SamplerConfig(**cfg, cache="block"))
    with pytest.raises(ValueError, match="editing_threshold .* cannot be used with sub_block_length"):
        generate(_fixture("sdar-tiny"), PROMPTS[:1], SamplerConfig(**cfg, sub_block_length=8))


def test_dual_cache_rows_with_hints_decode_as_they_do_alone():
    """A hint at a sub-block's first position moves a row to that sub-block without a refresh: it reads the previous
    sub-block's keys/values from its last window, whether its group ran alone or with the whole batch."""
    model = _fixture("fastdllmv2-tiny", torch.float64)
    cfg = SamplerConfig(**FAST, threshold=0.5, cache="dual")
    hints = torch.full((len(PROMPTS), cfg.gen_length), -1, dtype=torch.long)
    for i, prompt in enumerate(PROMPTS):
        P = len(prompt)
        for start in (32, 40, 48, 64, 72):  # first positions of sub-blocks of the generated blocks
            if 0 <= start - P < cfg.gen_length:
                hints[i, start - P] = 100 + i
    batched = generate(model, PROMPTS, cfg, hints=hints)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], cfg, hints=hints[i:i + 1])
        assert torch.equal(batched.completion_ids[i], alone.completion_ids[0])
