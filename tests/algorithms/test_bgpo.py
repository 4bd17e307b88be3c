import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.bgpo import BGPOConfig, bgpo_bound, bgpo_ratio
from dare.trainer.recipe import load_recipe
from dare.diffusion.logprob import score_targets
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.helpers import rl_batch
# shared tiny `dare train` runners and the autouse one-thread fixture
from tests.algorithms.toy_task import ROOT, learns_toy_reward, one_thread  # noqa: F401


def _setup(family="llada", **cfg):
    cfg.setdefault("num_mc", 3)
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo = build_algorithm(BGPOConfig(**cfg))
    return model, algo, StepContext(step=6, seed=1, adapter=model.adapter)


def _prepare(algo, ctx, model, batch, reference=None):
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, reference=reference, micro_batch_size=3)
    ctx.norms = algo.normalizers(batch)
    return batch


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _perturb(model, scale, seed):
    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + k)))


def test_defaults():
    cfg = BGPOConfig()
    assert cfg.num_mc == 16 and cfg.per_sample_backward and cfg.dual_clip == 3.0
    assert build_algorithm(cfg).mc_samples == 16


def test_bound_is_below_the_objective_and_never_nan():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        delta = torch.randn(8, 5, generator=g) * 2
        adv = torch.randn(8, generator=g)
        objective = adv * torch.exp(delta.mean(-1))
        assert (bgpo_bound(delta, adv) <= objective + 1e-6).all()
    # exact on-policy
    adv = torch.tensor([1.5, -0.5, 0.0])
    assert torch.equal(bgpo_bound(torch.zeros(3, 4), adv), adv)
    # Delta < -1 with A > 0 (log(1 + Delta) would be NaN) and huge Delta with A < 0 stay finite with finite gradients
    delta = torch.tensor([[-3.0, -10.0], [200.0, 1.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    r = bgpo_ratio(delta, adv)
    assert torch.isfinite(r).all() and r[0, 0] == -2.0
    r.sum().backward()
    assert torch.isfinite(delta.grad).all()


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_on_policy_bound_is_a_and_gradient_matches_exp_objective(family):
    model, algo, ctx = _setup(family, inner_iterations=1, dual_clip=None)
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=2, group=3, seed=2))
    adv = batch.advantages.values
    assert (adv > 0).any() and (adv < 0).any()
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=6)
    assert metrics["loss"] == pytest.approx(-(adv.sum() / batch.size).item(), abs=1e-6)  # bound = A
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_frac"] == 0.0
    bound_grad = _grads(model)
    model.zero_grad(set_to_none=True)
    value = algo.log_likelihood(ctx, model, batch, batch.views[0]).value
    delta = value - value.detach()
    (-(adv * torch.exp(delta.mean(-1))).sum() / batch.size).backward()
    exact = _grads(model)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-8) for a, b in zip(bound_grad, exact))
    assert any(a.abs().sum() > 0 for a in exact)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_per_sample_backward_equals_full_graph_gradient(family):
    model, algo, ctx = _setup(family, inner_iterations=2, beta=0.3, clip_low=0.01, kl_target="old")
    batch = _prepare(algo, ctx, model, rl_batch(n_prompts=2, group=3, seed=3))
    _perturb(model, 0.05, 100)  # off-policy: Delta != 0, some samples clip
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    m_each = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    handle.remove()
    assert len(calls) == 2 * algo.config.num_mc  # one forward per MC sample and micro-batch
    each = _grads(model)
    model.zero_grad(set_to_none=True)
    algo.config.per_sample_backward = False
    m_full = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    full = _grads(model)
    assert m_each["loss"] == pytest.approx(m_full["loss"], rel=1e-5)
    assert m_each["ratio_mean"] == pytest.approx(m_full["ratio_mean"], rel=1e-6)
    assert 0 < m_full["clip_frac"] < 1 and m_full["kl"] > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(each, full))


def test_estimator_is_masked_token_mean_with_stratified_counts():
    model, algo, ctx = _setup("dream", num_mc=4)
    batch = rl_batch(n_prompts=2, group=2, gen_len=10, seed=4)
    views = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    valid = batch.completion_mask
    L = valid.sum(-1)
    value = algo.log_likelihood(ctx, model, batch, views).value
    assert value.shape == (batch.size, 4)
    counts = torch.stack([v.targets[:, P:].sum(-1) for v in views], 1)
    for i in range(batch.size):  # stratified counts in 1..L, evenly spread
        c = torch.sort(counts[i]).values
        gaps = torch.diff(c)
        assert c.min() >= 1 and c.max() <= L[i] and (gaps <= L[i] / 4 + 1).all() and (gaps >= L[i] // 4).all()
    for j, v in enumerate(views):
        masked = v.input_ids[:, P:] == mask_id
        assert masked[~valid].all() and torch.equal(masked & valid, v.targets[:, P:])
        lp, _ = score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask)
        assert torch.allclose(value[:, j], (lp * v.targets).sum(-1) / counts[:, j], atol=1e-6)


def test_block_models_use_the_block_diffusion_layout_and_ignore_future_blocks():
    model, algo, ctx = _setup("sdar", num_mc=2)
    batch = rl_batch(n_prompts=1, group=2, gen_len=12, seed=5)
    batch.completion_mask[:] = True
    views = algo.corrupt(ctx, batch, 0)
    v = views[0]
    W = batch.prompt_ids.shape[1] + 12
    assert v.layout is not None and v.input_ids.shape[1] == 2 * W and v.attention_mask is None
    lp, _ = score_targets(model, v.input_ids, v.targets, v.labels, layout=v.layout)
    # the last completion block's clean tokens only feed later (non-existent) blocks: changing them leaves every
    # earlier block's log-probs unchanged
    changed = v.input_ids.clone()
    changed[:, -2:] = 50
    lp2, _ = score_targets(model, changed, v.targets, v.labels, layout=v.layout)
    assert torch.equal(lp[:, :W - 4], lp2[:, :W - 4])


def test_unsupported_config():
    with pytest.raises(ValueError, match="num_mc"):
        BGPOConfig(num_mc=0)


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/bgpo.yaml")
    assert isinstance(recipe.algorithm, BGPOConfig) and recipe.algorithm.num_mc == 16


@pytest.mark.integration
def test_learns_a_toy_reward(tmp_path):
    learns_toy_reward(tmp_path, "bgpo", "sdar", "algorithm.num_mc=4")
