import copy

import pytest
import torch

from dare.algorithms import LogLik, StepContext, build_algorithm
from dare.algorithms.common.elbo import stratified_counts
from dare.algorithms.espo import ESPOConfig
from dare.trainer.recipe import load_recipe
from dare.diffusion.logprob import score_targets
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.block_checks import (assert_future_blocks_invisible, assert_matches_brute_force, block_model,
                                           brute_force_logp)
from tests.algorithms.helpers import rl_batch
from tests.algorithms.toy_task import ROOT, learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.test_loss_parity import _hidden, case_batch, estimator_and_loss, leaf, runner


def _setup(family="llada", **cfg):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo = build_algorithm(ESPOConfig(**cfg))
    return model, algo, StepContext(step=4, seed=9, adapter=model.adapter)


class _Ref:
    def __init__(self, model):
        self.model = model

    def scoring(self):
        return stages.frozen(self.model)


def _prepare(algo, ctx, model, batch, reference=None):
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, reference=reference, micro_batch_size=3)
    ctx.norms = algo.normalizers(batch)
    return batch


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_stratified_counts_cover_the_range_evenly_and_are_uniform():
    L, n = 10, 4
    for low in (0, 1):
        span = L + 1 - low
        hist = torch.zeros(L + 1)
        for s in range(3000):
            x = stratified_counts(torch.Generator().manual_seed(s), L, n, low)
            assert x.min() >= low and x.max() <= L
            gaps = torch.diff(torch.sort(x).values).float()
            assert (gaps - span / n).abs().max() <= 1.0 + 1e-6  # one count per stratum of the cycle
            hist += torch.bincount(x, minlength=L + 1)
        freq = hist[low:] / hist.sum()
        assert (freq - 1 / span).abs().max() < 0.01  # each count marginally uniform


def test_main_and_complement_partition_the_completion():
    model, algo, ctx = _setup(num_mc=3)
    batch = rl_batch(n_prompts=3, group=2, gen_len=12, seed=1)
    views = algo.corrupt(ctx, batch, 0)
    assert len(views) == 6 == algo.mc_samples
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    valid = batch.completion_mask
    L = valid.sum(-1)
    counts = []
    for main, comp in zip(views[::2], views[1::2]):
        tm, tc = main.targets[:, P:], comp.targets[:, P:]
        assert not (tm & tc).any() and torch.equal(tm | tc, valid)
        for v in (main, comp):
            masked = v.input_ids[:, P:] == mask_id
            assert torch.equal(masked & valid, v.targets[:, P:]) and masked[~valid].all()  # post-EOS marginalised
            assert torch.equal(v.input_ids[:, :P], batch.prompt_ids)
        x = tm.sum(-1)
        counts.append(x)
        assert torch.allclose(main.info["p"], x / (L + 1)) and torch.allclose(comp.info["p"], (L - x) / (L + 1))
    assert not all(torch.equal(counts[0], c) for c in counts[1:])  # stratified, not repeated


def test_elbo_is_the_averaged_weighted_sum_of_main_and_complement_passes():
    model, algo, ctx = _setup("dream", num_mc=2)
    batch = rl_batch(n_prompts=2, group=2, gen_len=10, seed=2)
    views = algo.corrupt(ctx, batch, 0)
    value = algo.log_likelihood(ctx, model, batch, views).value
    expected = torch.zeros(batch.size)
    for v in views:
        lp, _ = score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask)
        p = v.info["p"].clamp_min(1e-12)
        expected += 0.5 / 2 * (lp * v.targets).sum(-1) / p
    assert value.shape == (batch.size, 1)
    assert torch.allclose(value[:, 0], expected, rtol=1e-5)
    assert (value < 0).all()


def test_ratio_is_one_with_shared_noise_and_not_without():
    model, algo, ctx = _setup(inner_iterations=2, beta=0.0)
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=2, group=3, seed=3))
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and metrics["clip_frac"] == 0.0
    assert metrics["loss"] == pytest.approx(-(batch.advantages.values.sum() / batch.size).item(), abs=1e-6)
    other = StepContext(step=5, seed=9, adapter=ctx.adapter)  # different noise: the estimate moves
    fresh = algo.log_likelihood(other, model, batch, algo.corrupt(other, batch, 0)).value
    assert not torch.allclose(fresh, batch.old_logp[0], atol=1e-3)


def test_two_pass_gradient_equals_full_graph_gradient_with_clipping_and_kl():
    model, algo, ctx = _setup(inner_iterations=2, beta=0.5, num_mc=2, clip_low=0.02)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=2, group=3, seed=4), reference=_Ref(ref))
    with torch.no_grad():  # move the policy away from the old one so ratios differ and some clip
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + 1)))
    m_two = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    two = _grads(model)
    model.zero_grad(set_to_none=True)
    algo.config.two_pass_backward = False
    m_full = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    full = _grads(model)
    assert m_two["loss"] == pytest.approx(m_full["loss"], rel=1e-5)
    assert 0 < m_full["clip_frac"] < 1 and m_full["kl"] > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(two, full))
    assert any(a.abs().sum() > 0 for a in two)


def test_k2_kl_on_raw_elbo_over_length():
    model, algo, ctx = _setup(inner_iterations=1, beta=1.0, two_pass_backward=False)
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=1, group=3, seed=5), reference=_Ref(model))
    assert stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)["kl"] == 0.0
    current = algo.log_likelihood(ctx, model, batch, batch.views[0])
    batch.ref_logp[0] = current.value.detach() - 2.0  # ELBO gap 2 -> k2 = 2 / L
    _, metrics = algo.loss(ctx, batch, current, 0)
    L = batch.completion_mask.sum(-1).float()
    assert metrics["kl"] == pytest.approx((2.0 / L).mean().item(), rel=1e-5)


# --- block-diffusion models: the sequence ELBO is the block NELBO over [x_t ; x_0] ----------------------------------


def _block_setup(family="sdar", **cfg):
    model = block_model(family)
    return model, build_algorithm(ESPOConfig(**cfg)), StepContext(step=4, seed=9, adapter=model.adapter)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_nelbo_from_per_block_forwards(family):
    model, algo, ctx = _block_setup(family, num_mc=2)
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=1)
    views = algo.corrupt(ctx, batch, 0)
    P = batch.prompt_ids.shape[1]
    valid = batch.completion_mask
    for main, comp in zip(views[::2], views[1::2]):  # the complement pass still partitions the completion
        tm, tc = main.targets[:, P:], comp.targets[:, P:]
        assert not (tm & tc).any() and torch.equal(tm | tc, valid)
        assert torch.equal(main.input_ids[:, 2 * P + 12:], batch.completion_ids)  # clean copy
    assert_matches_brute_force(model, batch, views)
    expected = sum((brute_force_logp(model, batch, v, 4) * v.weight).sum(-1) for v in views)
    value = algo.log_likelihood(ctx, model, batch, views).value
    assert torch.allclose(value[:, 0], expected, rtol=1e-5) and (value < 0).all()


def test_block_terms_ignore_later_blocks():
    model, algo, ctx = _block_setup(num_mc=2)
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=2)
    batch.completion_mask[:] = True
    assert_future_blocks_invisible(model, batch, algo.corrupt(ctx, batch, 0))


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_ratio_is_one_with_shared_noise(family):
    model, algo, ctx = _block_setup(family, inner_iterations=2, beta=0.0, num_mc=2)
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=2, group=3, seed=3))
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and metrics["clip_frac"] == 0.0
    assert metrics["loss"] == pytest.approx(-(batch.advantages.values.sum() / batch.size).item(), abs=1e-6)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_sequence_ratio_is_length_normalised_and_clipped_per_sequence():
    _, algo, ctx = _setup(inner_iterations=2, beta=0.0, clip_low=0.2)
    batch = rl_batch(n_prompts=1, group=4, seed=6, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]))
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    L = batch.completion_mask.sum(-1).float()
    old = -torch.rand(4, 1) * 50
    target = torch.tensor([1.1, 1.1, 1.5, 0.5])  # two inside the clip range, two outside
    batch.old_logp = {0: old}
    value = (old[:, 0] + L * torch.log(target))[:, None].requires_grad_(True)
    loss, metrics = algo.loss(ctx, batch, LogLik(value), 0)
    loss.backward()
    assert metrics["ratio_mean"] == pytest.approx(target.mean().item(), rel=1e-5)
    adv = batch.advantages.values
    # A > 0 at ratio 1.5 and A < 0 at ratio 0.5 are clipped: no gradient; the others: -A rho / (L * #seqs)
    expected = torch.tensor([-adv[0] * 1.1 / L[0], -adv[1] * 1.1 / L[1], 0.0, 0.0]) / 4
    assert torch.allclose(value.grad[:, 0], expected, atol=1e-6)
    assert metrics["clip_frac"] == pytest.approx(0.5)


def test_noise_replays_per_iteration_and_microbatch():
    _, algo, ctx = _setup(num_mc=2)
    batch = rl_batch(n_prompts=3, group=2, gen_len=10)
    a, b, c = (algo.corrupt(ctx, batch, it) for it in (0, 0, 1))
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
    sub = algo.corrupt(ctx, batch.select([4, 2]), 0)
    assert all(torch.equal(s.input_ids, x.input_ids[[4, 2]]) and torch.equal(s.weight, x.weight[[4, 2]])
               for s, x in zip(sub, a))


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learns_a_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "espo", family, "algorithm.num_mc=2", "algorithm.beta=0.0")


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/espo.yaml")
    assert isinstance(recipe.algorithm, ESPOConfig) and recipe.algorithm.num_mc == 16 and recipe.algorithm.antithetic


# `dare train` for 2 steps on every supported family: tests/algorithms/test_matrix.py.


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("espo")
def loss_parity_espo(algo, x, monkeypatch):
    """ESPO's MC masks (the reference's), main + complement ELBO and sequence-level loss."""
    from dare.algorithms import espo as module
    monkeypatch.setattr(module, "stratified_masks", lambda *a, **k: (x["main_masked"], x["counts"]))
    passes = leaf(x, "logp_passes")  # [MC sample, main / complement, B, Lc]: dare's view order
    return estimator_and_loss(algo, case_batch(x), {"logp_passes": passes}, _hidden(x, list(passes.flatten(0, 1))))
