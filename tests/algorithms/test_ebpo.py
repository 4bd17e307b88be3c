import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.ebpo import EBPOConfig
from dare.trainer.recipe import load_recipe
from dare.diffusion.logprob import score_targets
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.helpers import rl_batch
# shared tiny `dare train` runners and the autouse one-thread fixture
from tests.algorithms.toy_task import ROOT, learns_toy_reward, one_thread  # noqa: F401


def _setup(family="sdar", **cfg):
    cfg.setdefault("num_mc", 3)
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    model.adapter.block_size = 4  # tiny completions span several blocks (LLaDA2's default is 32)
    algo = build_algorithm(EBPOConfig(**cfg))
    return model, algo, StepContext(step=8, seed=5, adapter=model.adapter)


def _prepare(algo, ctx, model, batch):
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=3)
    ctx.norms = algo.normalizers(batch)
    return batch


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _token_logp(model, view):
    lp, _ = score_targets(model, view.input_ids, view.targets, view.labels, layout=view.layout)
    return lp


def _blocks(batch, i, P, bs=4):
    """Column ranges [start, end) of row i's completion blocks (absolute positions from the real prompt start)."""
    pad = P - int(batch.prompt_mask[i].sum())
    L = int(batch.completion_mask[i].sum())
    out, col = [], P
    while col < P + L:
        end = pad + ((col - pad) // bs + 1) * bs
        out.append((col, end))
        col = end
    return out


def test_every_block_noised_at_the_stratified_level_with_count_weights():
    model, algo, ctx = _setup(num_mc=4)
    batch = rl_batch(n_prompts=2, group=2, gen_len=14, seed=1)
    P, W, mask_id = batch.prompt_ids.shape[1], batch.prompt_ids.shape[1] + 14, model.adapter.mask_token_id
    views = algo.corrupt(ctx, batch, 0)
    t = torch.stack([v.info["t"] for v in views])  # [N, B]
    assert torch.equal(torch.sort(torch.floor(t * 4), 0).values, torch.arange(4.0)[:, None].expand(4, batch.size))
    valid = batch.completion_mask
    for k, v in enumerate(views):
        assert v.layout is not None and v.input_ids.shape[1] == 2 * W
        noisy = v.input_ids[:, :W]
        assert torch.equal(v.input_ids[:, W:], v.labels)  # clean copy
        assert torch.equal(noisy[:, :P], batch.prompt_ids)  # prompt never masked
        masked = noisy[:, P:] == mask_id
        assert masked[~valid].all() and torch.equal(masked & valid, v.targets[:, P:])
        for i in range(batch.size):
            for s, e in _blocks(batch, i, P):
                e_valid = min(e, P + int(valid[i].sum()))
                nb = e_valid - s
                m = int(v.targets[i, s:e_valid].sum())
                assert m == min(int(float(t[k, i]) * nb) + 1, nb)  # at least one masked token per block
                w = v.weight[i, s:e_valid][v.targets[i, s:e_valid]]
                assert torch.allclose(w, torch.full_like(w, nb / (m * 4)))


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_vectorised_block_terms_equal_separate_per_block_forwards(family):
    model, algo, ctx = _setup(family, num_mc=2)
    batch = rl_batch(n_prompts=2, group=1, gen_len=12, seed=2)
    P, W = batch.prompt_ids.shape[1], batch.prompt_ids.shape[1] + 12
    attn = torch.cat([batch.prompt_mask, torch.ones_like(batch.completion_mask)], 1)
    for v in algo.corrupt(ctx, batch, 0):
        vec = _token_logp(model, v)
        noisy, clean = v.input_ids[:, :W], v.labels
        for i in range(batch.size):
            for s, e in _blocks(batch, i, P):
                # prompt + clean earlier blocks + this noisy block, plain block-causal attention, no [x_t ; x_0]
                x = torch.cat([clean[i, :s], noisy[i, s:e]])[None]
                out = model(x, attention_mask=attn[i:i + 1, :e]).logits.float().log_softmax(-1)
                sep = out[0, torch.arange(s, e), clean[i, s:e]]
                tgt = v.targets[i, s:e]
                assert tgt.any() or s >= P + int(batch.completion_mask[i].sum())
                assert torch.allclose(vec[i, s:e][tgt], sep[tgt], atol=1e-5)


def test_block_terms_are_invariant_to_future_blocks():
    model, algo, ctx = _setup(num_mc=2)
    batch = rl_batch(n_prompts=1, group=2, gen_len=12, seed=3)
    batch.completion_mask[:] = True
    P = batch.prompt_ids.shape[1]
    before = [_token_logp(model, v) for v in algo.corrupt(ctx, batch, 0)]
    last_start = _blocks(batch, 0, P)[-1][0]
    assert _blocks(batch, 1, P)[-1][0] == last_start
    batch.completion_ids[:, last_start - P:] = 42  # rewrite the last block (same masks: noise is keyed by uid)
    after = [_token_logp(model, v) for v in algo.corrupt(ctx, batch, 0)]
    for a, b in zip(before, after):
        assert torch.equal(a[:, :last_start], b[:, :last_start])
        assert not torch.equal(a[:, last_start:], b[:, last_start:])


def test_composite_elbo_value_and_unit_ratio_on_policy():
    model, algo, ctx = _setup(num_mc=3, inner_iterations=2)
    batch = rl_batch(n_prompts=2, group=3, seed=4)
    views = algo.corrupt(ctx, batch, 0)
    value = algo.log_likelihood(ctx, model, batch, views).value
    expected = sum((_token_logp(model, v) * v.weight).sum(-1) for v in views)
    assert torch.allclose(value[:, 0], expected, rtol=1e-5) and (value < 0).all()
    _prepare(algo, ctx, model, batch)
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and metrics["clip_frac"] == 0.0
    assert metrics["loss"] == pytest.approx(-(batch.advantages.values.sum() / batch.size).item(), abs=1e-6)


def test_two_pass_gradient_equals_full_graph_gradient():
    model, algo, ctx = _setup("llada2", num_mc=2, inner_iterations=2, clip_low=0.01, beta=0.2, kl_target="old")
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0])
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=2, group=3, seed=5, rewards=rewards))
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    m_two = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    two = _grads(model)
    model.zero_grad(set_to_none=True)
    algo.config.two_pass_backward = False
    m_full = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert m_two["loss"] == pytest.approx(m_full["loss"], rel=1e-5) and 0 < m_full["clip_frac"] < 1
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(two, _grads(model)))


def test_masked_models_are_rejected():
    _, algo, ctx = _setup("llada")
    with pytest.raises(ValueError, match="block_causal"):  # the trainer's start-up check
        algo.check_model(ctx.adapter)


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/ebpo.yaml")
    assert isinstance(recipe.algorithm, EBPOConfig) and recipe.algorithm.num_mc == 16


@pytest.mark.integration
def test_learns_a_toy_reward(tmp_path):
    learns_toy_reward(tmp_path, "ebpo", "sdar", "algorithm.num_mc=4")
