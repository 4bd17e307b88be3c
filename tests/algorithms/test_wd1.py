import pytest
import torch

from dare.algorithms import LogLik, StepContext, build_algorithm
from dare.algorithms.d1 import D1Config
from dare.algorithms.wd1 import WD1Config, group_softmax
from dare.trainer.recipe import load_recipe
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.block_checks import (assert_future_blocks_invisible, assert_matches_brute_force, block_model,
                                           brute_force_logp)
from tests.algorithms.helpers import rl_batch
# shared tiny `dare train` runners and the autouse one-thread fixture
from tests.algorithms.toy_task import ROOT, learns_toy_reward, one_thread  # noqa: F401


def _setup(family="llada", **cfg):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo = build_algorithm(WD1Config(**cfg))
    return model, algo, StepContext(step=1, seed=3, adapter=model.adapter)


def _prepared(algo, ctx, model, batch):
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    return batch


def test_weights_are_per_group_softmaxes_summing_to_one():
    _, algo, ctx = _setup()
    r = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.5, 0.5, 1.0, 0.0, 0.3])
    batch = rl_batch(n_prompts=3, group=3, rewards=r)
    out = algo.advantages(ctx, batch)
    adv, wp, wn = out.values, out.w_pos, out.w_neg
    for g in range(3):
        sel = slice(3 * g, 3 * g + 3)
        assert wp[sel].sum().item() == pytest.approx(1.0) and wn[sel].sum().item() == pytest.approx(1.0)
        assert torch.allclose(wp[sel], torch.softmax(adv[sel], 0)) and torch.allclose(wn[sel], torch.softmax(-adv[sel], 0))
    assert torch.allclose(adv[:3], r[:3] - r[:3].mean())  # A = r - mean, no std
    # the softmax never mixes groups
    assert torch.allclose(group_softmax(torch.tensor([0.0, 1.0, 5.0, 5.0]), torch.tensor([0, 0, 1, 1])),
                          torch.tensor([1 / (1 + torch.e), torch.e / (1 + torch.e), 0.5, 0.5]))


def test_equal_advantages_give_zero_loss_and_zero_gradient():
    model, algo, ctx = _setup(inner_iterations=2)
    batch = _prepared(algo, ctx, model, rl_batch(n_prompts=2, group=3, rewards=torch.tensor([1.0] * 3 + [0.0] * 3)))
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert metrics["loss"] == 0.0
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())


def test_gradient_on_sequence_logp_follows_weight_difference():
    model, algo, ctx = _setup()
    batch = rl_batch(n_prompts=2, group=3, seed=1, rewards=torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0]))
    _prepared(algo, ctx, model, batch)
    value = torch.randn(batch.completion_ids.shape, requires_grad=True)
    loss, _ = algo.loss(ctx, batch, LogLik(value), 0)
    loss.backward()
    m = batch.completion_mask.float()
    diff = batch.advantages.w_pos - batch.advantages.w_neg
    # dL/dS_i = (w-_i - w+_i) / #groups on every scored token; descent raises S_i iff w+_i > w-_i
    assert torch.allclose(value.grad, (-diff / 2)[:, None] * m, atol=1e-7)
    assert torch.equal(torch.sign(-value.grad.sum(-1)), torch.sign(diff))
    assert loss.item() == pytest.approx((-(diff[:, None] * value * m).sum() / 2).item(), rel=1e-5)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learning_raises_best_completion_likelihood(family):
    model, algo, ctx = _setup(family, p_mask_prompt=0.0, inner_iterations=1)
    batch = rl_batch(n_prompts=1, group=3, seed=2, rewards=torch.tensor([1.0, 0.0, 0.0]))
    _prepared(algo, ctx, model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    views = batch.views[0]
    before = algo.log_likelihood(ctx, model, batch, views).value.detach()
    for _ in range(3):
        opt.zero_grad()
        stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
        opt.step()
    after = algo.log_likelihood(ctx, model, batch, views).value.detach()
    m = batch.completion_mask.float()
    gain = ((after - before) * m).sum(-1)
    assert gain[0] > 0 and gain[1] < 0 and gain[2] < 0


def test_no_old_or_reference_pass_and_kl_rejected():
    _, algo, _ = _setup(inner_iterations=12)
    assert not algo.needs_old_logp and not algo.needs_reference and algo.inner_iterations == 12
    with pytest.raises(ValueError, match="beta"):
        WD1Config(beta=0.04)


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_models_use_d1_block_estimate(family):
    model = block_model(family)
    algo = build_algorithm(WD1Config(p_mask_prompt=0.2))
    ctx = StepContext(step=1, seed=3, adapter=model.adapter)
    assert set(algo.supports) == {"bidirectional", "block_causal", "encoder_decoder"}
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=4)
    views = algo.corrupt(ctx, batch, 0)
    (d1_view,) = build_algorithm(D1Config(p_mask_prompt=0.2)).corrupt(ctx, batch, 0)
    assert torch.equal(views[0].input_ids, d1_view.input_ids) and views[0].layout is not None
    assert_matches_brute_force(model, batch, views)
    assert_future_blocks_invisible(model, batch, views)
    # S_i = sum of the per-block brute-force terms; the loss weighs it by (w- - w+) / #groups
    _prepared(algo, ctx, model, batch)
    value = algo.log_likelihood(ctx, model, batch, batch.views[0]).value
    P = batch.prompt_ids.shape[1]
    m = batch.completion_mask.float()
    S = (brute_force_logp(model, batch, views[0], 4)[:, P:] * m).sum(-1)
    loss, _ = algo.loss(ctx, batch, LogLik(value), 0)
    expected = ((batch.advantages.w_neg - batch.advantages.w_pos) * S).sum() / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/wd1.yaml")
    assert isinstance(recipe.algorithm, WD1Config) and recipe.algorithm.beta == 0.0


# `dare train` for 2 steps on every supported family: tests/algorithms/test_matrix.py.


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learns_a_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "wd1", family, "algorithm.inner_iterations=2")
