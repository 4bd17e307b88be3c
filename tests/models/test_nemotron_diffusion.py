"""Nemotron-Labs-Diffusion against its reference (tests/assets/fixtures/nemotron-tiny, made by the Hub modeling code):
the causal mode of the same weights, YaRN and Llama 4's query scale, the published tensor names and config checks.
(Bidirectional logits: tests/models/test_parity.py; the decoders: tests/rollout/test_fixture_parity.py.)"""
import dataclasses
import json

import pytest
import torch

from dare.models import load_model
from dare.models.arch import RopeScaling
from dare.models.families import UnsupportedModelError, get_family
from dare.models.modules import RotaryEmbedding, yarn_inv_freq
from tests.conftest import FIXTURES

FOLDER = FIXTURES / "nemotron-tiny"


@pytest.fixture(scope="module")
def model():
    return load_model(FOLDER, dtype=torch.float32)


@pytest.fixture(scope="module")
def expected():
    return torch.load(FOLDER / "expected_logits.pt")


def _causal_mask(B: int, L: int) -> torch.Tensor:
    return torch.ones(L, L, dtype=torch.bool).tril()[None, None].expand(B, 1, L, L)


def test_causal_mode_logits_match_the_reference(model, expected):
    """The decoders' AR mode (every layer's diffusion_lm off, a causal mask): the same weights under a causal mask."""
    ids = expected["input_ids"]
    with torch.no_grad():
        got = model(ids, attention_mask=_causal_mask(*ids.shape)).logits
    assert (got - expected["logits_causal"]).abs().max() <= 1e-4


def test_query_scale_and_yarn_act_at_the_fixture_positions(model, expected):
    """The fixture's original context is 32 positions (80 are fed), so both YaRN's frequencies and the Llama 4 query
    scale act: without either, the logits leave the reference."""
    ids = expected["input_ids"]
    arch = model.arch
    assert arch.rope_scaling.factor == 16.0 and arch.query_scale_beta == 0.1 and arch.query_scale_span == 32
    plain = dataclasses.replace(arch, query_scale_beta=0.0)
    model.arch = plain
    try:
        with torch.no_grad():
            off = model(ids).logits
    finally:
        model.arch = arch
    assert (off - expected["logits"]).abs().max() > 1e-3
    rope = RotaryEmbedding(arch.rotary_dim, arch.rope_theta)
    assert not torch.allclose(rope.inv_freq, model.rotary.inv_freq)


def test_yarn_frequencies_follow_the_formula():
    """YaRN keeps the fast dimensions (more than beta_fast turns over the original context), divides the slow ones
    (fewer than beta_slow) by the factor, and ramps linearly between."""
    dim, theta, span = 128, 1e6, 16384
    scaling = RopeScaling(factor=16.0, original_max_position_embeddings=span)
    base = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv = yarn_inv_freq(base, dim, theta, scaling)
    turns = span * (1 / base) / (2 * torch.pi)  # rotations of each dimension over the original context
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any()
    assert torch.equal(inv[fast], (1 / base)[fast])
    assert torch.allclose(inv[slow], (1 / base)[slow] / 16)
    ratio = inv * base  # 1 (kept) .. 1/16 (interpolated), monotone in between
    assert bool((ratio[1:] <= ratio[:-1] + 1e-7).all())


def test_published_tensor_names_and_config_checks():
    fam = get_family("nemotron_diffusion")
    assert fam.to_native("encoder.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert fam.to_native("diffusion_head.weight") == "lm_head.weight"
    assert fam.to_published("model.norm.weight") == "encoder.norm.weight"
    cfg = json.loads((FOLDER / "config.json").read_text())
    assert fam.matches(cfg) and fam.adapter(cfg, 500).causal_mode
    for key, value, match in (("dlm_paradigm", "block_diff", "dlm_paradigm"), ("sliding_window", 4096, "sliding_window")):
        with pytest.raises(UnsupportedModelError, match=match):
            fam.read_arch({**cfg, key: value})
    bad = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_type": "longrope"}}
    with pytest.raises(UnsupportedModelError, match="rope_type 'longrope'"):
        fam.read_arch(bad)


def test_published_8b_config_reads():
    """The shipped full-size config (dare plan) gives the 8B architecture."""
    from dare.plan.models import shipped_config
    cfg = shipped_config("nvidia/Nemotron-Labs-Diffusion-8B")["config"]
    arch = get_family("nemotron_diffusion").read_arch(cfg)
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (34, 4096, 32, 8, 128)
    assert arch.rope_scaling.original_max_position_embeddings == 16384 and arch.query_scale_span == 16384


def test_decoder_settings_are_checked(model):
    from dare.rollout import SamplerConfig, generate
    with pytest.raises(ValueError, match="speculative .* needs cache='causal'"):
        SamplerConfig(gen_length=16, block_length=8, speculative=True)
    cfg = SamplerConfig(gen_length=16, block_length=8, cache="causal", speculative=True)
    with pytest.raises(ValueError, match="hints cannot be used with speculative decoding"):
        generate(model, [[5, 6, 7]], cfg, hints=torch.full((1, 16), -1))
    with pytest.raises(ValueError, match="speculative cannot be combined with pausing"):
        generate(model, [[5, 6, 7]], cfg, until_step=2)
    assert model.adapter.cache_kinds == ("none", "prefix", "dual", "block", "causal")


@pytest.mark.parametrize("cache", ["block", "causal"])
def test_exact_caches_decode_padded_batches_as_rows_alone(model, cache):
    """Left-padded rows of different lengths decode as they do alone (the store passes hide the padding), with a
    threshold and a stop token, and with sampling (each row draws from its own generator)."""
    from dare.rollout import SamplerConfig, generate
    prompts = [[17, 112, 333], [5, 9, 44, 71, 300, 12, 8], [250]]
    for cfg in (SamplerConfig(gen_length=24, block_length=8, cache=cache, threshold=0.5, stop_token_ids=[458],
                              eos_early_stop=True),
                SamplerConfig(gen_length=16, block_length=8, cache=cache, temperature=0.8)):
        batched = generate(model, prompts, cfg, seeds=[1, 2, 3])
        for i, p in enumerate(prompts):
            alone = generate(model, [p], cfg, seeds=[i + 1])
            assert torch.equal(batched.completion_ids[i], alone.completion_ids[0]), (cache, i)
            assert int(batched.row_nfe[i]) == int(alone.row_nfe[0])


@pytest.mark.parametrize("cache", ["block", "causal"])
def test_exact_caches_resume_as_if_never_paused(model, cache):
    """A decode paused inside a block, or at a block's start, and resumed gives the uninterrupted decode's tokens; a
    pause at a block's start comes before the block's seed, so the branches of a resumed node each draw their own."""
    from dare.rollout import SamplerConfig, generate, resume
    prompts = [[17, 112, 333], [5, 9, 44, 71, 300, 12, 8]]
    cfg = SamplerConfig(gen_length=32, block_length=8, steps=32, cache=cache)
    whole = generate(model, prompts, cfg)
    for until in (8, 11, 17):
        part = generate(model, prompts, cfg, until_step=until)
        assert torch.equal(resume(model, part, cfg).completion_ids, whole.completion_ids), (cache, until)
    if cache == "causal":
        sampled = SamplerConfig(gen_length=16, block_length=8, steps=16, cache=cache, temperature=1.0)
        part = generate(model, prompts[:1], sampled, until_step=8, seeds=[0])
        assert int((part.completion_ids[0, 8:] != 500).sum()) == 0  # the second block is untouched at the pause
        kids = resume(model, part, sampled, n=4, seeds=[1])
        assert len({int(t) for t in kids.completion_ids[:, 8]}) > 1


def test_rcr_is_refused_with_the_causal_cache(model):
    from dare.rollout import SamplerConfig, generate
    with pytest.raises(ValueError, match="rcr .* cannot be used with cache='causal'"):
        generate(model, [[5, 6, 7]], SamplerConfig(gen_length=16, block_length=8, steps=8, cache="causal", rcr=True))


def test_sft_matches_the_reference_training_loss(model, monkeypatch):
    """The published paradigm's training loss (one t per example, masked tokens' CE / t over their count; the prompt
    never masked) is SFT with ``normalize: masked_tokens``: with the reference's own draws (expected_loss.pt) dare
    masks the same tokens and its loss equals the reference's."""
    from dare.algorithms import build_algorithm
    from dare.algorithms.sft import SFTConfig
    r = torch.load(FOLDER / "expected_loss.pt")
    algo = build_algorithm(SFTConfig(normalize="masked_tokens"))
    ctx, batch, masked = _reference_masks(monkeypatch, r, algo, model)
    (view,) = batch.views[0]
    assert torch.equal(view.targets, masked)
    ctx.norms = algo.normalizers(batch)
    assert ctx.norms["masked_tokens"] == r["masked_tokens"]
    with torch.no_grad():
        loss = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, batch.views[0]), 0)[0]
    assert abs(loss.item() - r["loss"].item()) < 1e-4, (loss.item(), r["loss"].item())



def _reference_masks(monkeypatch, r, algo, model):
    """Run the prepare stage with the reference's recorded draws (one t per row, then one draw per token)."""
    import dare.algorithms.sft as sft
    from dare.algorithms import StepContext
    from dare.trainer import stages
    from dare.trainer.data import SFTDoc, sft_rows_batch
    ids, keep = r["input_ids"], r["loss_mask"].bool()
    rows = [[SFTDoc(i, ids[i][~keep[i]].tolist(), ids[i][keep[i]].tolist())] for i in range(ids.shape[0])]
    batch = sft_rows_batch(rows, [0, 1], 1, False)
    times, tokens = iter(r["t_draws"].tolist()), iter(r["token_draws"])
    real_rand = torch.rand
    monkeypatch.setattr(sft, "sample_time", lambda g, lo, hi, eps: (1 - eps) * next(times) + eps)
    monkeypatch.setattr(torch, "rand", lambda n, generator=None: next(tokens) if n == ids.shape[1] else real_rand(n))
    ctx = StepContext(step=0, seed=0, adapter=model.adapter)
    stages.prepare(algo, ctx, batch, model)
    monkeypatch.undo()
    t = (1 - r["eps"]) * r["t_draws"][:, None] + r["eps"]
    return ctx, batch, (r["token_draws"] < t) & keep


def test_block_diff_sft_matches_the_reference_training_loss(model, monkeypatch):
    """The ``block_diff`` paradigm (``[x_t ; x_0]``, noisy blocks of 8 seeing themselves and the earlier clean blocks,
    the clean half token-causal, plus the clean half's next-token cross-entropy) is SFT with ``block_diff: 8``: with
    the reference's draws (expected_loss_block_diff.pt) both sums equal the reference's -- the masked tokens' CE / t,
    and the next-token CE over every pair of each row (15 of 16 tokens, prompt included)."""
    from dare.algorithms import build_algorithm
    from dare.algorithms.sft import SFTConfig
    r = torch.load(FOLDER / "expected_loss_block_diff.pt")
    algo = build_algorithm(SFTConfig(normalize="masked_tokens", block_diff=r["block_size"],
                                     ar_loss_weight=r["ar_loss_weight"]))
    ctx, batch, masked = _reference_masks(monkeypatch, r, algo, model)
    (view,) = batch.views[0]
    L = r["input_ids"].shape[1]
    assert view.input_ids.shape[1] == 2 * L and torch.equal(view.targets[:, :L], masked)
    assert torch.equal(view.layout.seg[:, L:], torch.full((2, L), 2)) and view.layout.block_size == 8
    ctx.norms = algo.normalizers(batch)
    assert ctx.norms["masked_tokens"] == r["masked_tokens"] and ctx.norms["ar_tokens"] == 2 * (L - 1)
    with torch.no_grad():
        loss, metrics = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, batch.views[0]), 0)
    diffusion = metrics["diffusion_loss"] * r["masked_tokens"]
    ar = metrics["ar_loss"] * ctx.norms["ar_tokens"]
    assert abs(diffusion - r["diffusion_sum"].item()) < 1e-3, (diffusion, r["diffusion_sum"].item())
    assert abs(ar - r["ar_sum"].item()) < 1e-3, (ar, r["ar_sum"].item())
    assert abs(diffusion + ar - r["loss_sum"].item()) < 2e-3
    assert loss.item() == pytest.approx(metrics["diffusion_loss"] + metrics["ar_loss"], rel=1e-6)


def test_block_diff_sft_trains_both_terms(model, monkeypatch):
    """One backward of the ``block_diff`` loss: finite, and both terms reach the weights (dropping the AR term changes
    the gradient)."""
    from dare.algorithms import build_algorithm
    from dare.algorithms.sft import SFTConfig
    r = torch.load(FOLDER / "expected_loss_block_diff.pt")
    grads = []
    for weight in (1.0, 0.0):
        algo = build_algorithm(SFTConfig(normalize="masked_tokens", block_diff=8, ar_loss_weight=weight))
        ctx, batch, _ = _reference_masks(monkeypatch, r, algo, model)
        ctx.norms = algo.normalizers(batch)
        model.zero_grad()
        out = algo.backward(ctx, model, batch, 0)
        assert all(torch.isfinite(torch.tensor(v)) for v in out.values()) and out["ar_loss"] > 0
        grads.append(model.lm_head.weight.grad.clone())
    model.zero_grad()
    assert grads[0].abs().sum() > 0 and not torch.allclose(grads[0], grads[1])


def test_block_diff_attention_is_the_reference_rule():
    """The layout's mask equals the reference's ``block_diff_mask`` predicate for every (query, key) of a 2 x 12
    input with blocks of 4 (written here from the reference's three cases)."""
    from dare.models import masks
    L, bs = 12, 4
    layout = masks.block_diffusion_layout(torch.arange(L)[None], clean_causal=True, block_size=bs)
    got = masks.dense_mask(layout, layout, layout.block_size)[0, 0]
    q, k = torch.arange(2 * L)[:, None], torch.arange(2 * L)[None, :]
    xq, xk = q >= L, k >= L
    bq, bk = torch.where(xq, q - L, q) // bs, torch.where(xk, k - L, k) // bs
    want = ((bq == bk) & ~xk & ~xq) | ((bq > bk) & xk & ~xq) | ((q >= k) & xk & xq)
    assert torch.equal(got, want)


def test_block_diff_is_refused_where_it_has_no_form():
    from dare.algorithms import StepContext, build_algorithm
    from dare.algorithms.sft import SFTConfig
    from dare.models import tiny
    from dare.trainer.data import SFTDoc, sft_rows_batch
    with pytest.raises(ValueError, match="block_diff >= 1"):
        SFTConfig(block_diff=0)
    algo = build_algorithm(SFTConfig(block_diff=4))
    batch = sft_rows_batch([[SFTDoc(0, [5, 6], [7, 8])]], [0], 1, False)
    for family in ("sdar", "dream"):
        with pytest.raises(ValueError, match="block_diff"):
            algo.corrupt(StepContext(step=0, seed=0, adapter=tiny(family).adapter), batch, 0)