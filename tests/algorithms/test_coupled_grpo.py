import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.coupled_grpo import CoupledGRPOConfig
from dare.trainer.recipe import load_recipe
from dare.diffusion.logprob import score_targets
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.block_checks import (assert_future_blocks_invisible, assert_matches_brute_force, block_model,
                                           brute_force_logp)
from tests.algorithms.helpers import rl_batch
# shared tiny `dare train` runners and the autouse one-thread fixture
from tests.algorithms.toy_task import ROOT, learns_toy_reward, one_thread  # noqa: F401
from tests.algorithms.test_loss_parity import _hidden, case_batch, estimator_and_loss, leaf, runner


def _setup(family="llada", **cfg):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo = build_algorithm(CoupledGRPOConfig(**cfg))
    return model, algo, StepContext(step=2, seed=7, adapter=model.adapter)


def _masked_completion(view, P, mask_id):
    return view.input_ids[:, P:] == mask_id


def test_complementary_masks_are_disjoint_and_cover_the_completion():
    model, algo, ctx = _setup()
    batch = rl_batch(n_prompts=3, group=2, gen_len=12)
    v0, v1, v2 = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    m0, m1, m2 = (_masked_completion(v, P, mask_id) for v in (v0, v1, v2))
    assert m0.all()  # v0: the whole completion masked
    assert not (m1 & m2).any() and (m1 | m2).all()  # v1, v2 partition the completion
    assert torch.equal(m1, v1.info["v1"])
    cmask = batch.completion_mask
    for v, m in ((v1, m1), (v2, m2)):  # scored = masked and up to the first EOS; prompt never masked or scored
        assert torch.equal(v.targets[:, P:], m & cmask) and not v.targets[:, :P].any()
        assert torch.equal(v.input_ids[:, :P], batch.prompt_ids)
    t = v1.info["t"]
    assert ((t >= 0.2) & (t <= 0.8)).all() and len(set(t.tolist())) == batch.size  # one t per sample
    # the 1/t and 1/(1-t) ELBO weights, halved
    w1 = v1.weight[:, P:]
    assert torch.allclose(w1[m1 & cmask], (0.5 / t[:, None]).expand_as(w1)[m1 & cmask])
    w2 = v2.weight[:, P:]
    assert torch.allclose(w2[m2 & cmask], (0.5 / (1 - t[:, None])).expand_as(w2)[m2 & cmask])


def test_group_shared_t_cancels_the_weight_scaled_common_direction():
    """t_sharing=group: one t per group, fresh masks per sample, so sum_i A_i w_i = 0 within every group."""
    model, algo, ctx = _setup(t_sharing="group")
    batch = rl_batch(n_prompts=3, group=4, gen_len=12)
    _, v1, v2 = algo.corrupt(ctx, batch, 0)
    t, group = v1.info["t"], batch.group
    for g in group.unique():
        assert len(set(t[group == g].tolist())) == 1
    assert len(set(t.tolist())) == 3  # fresh across groups
    masks = v1.info["v1"]
    assert len({tuple(m.tolist()) for m in masks}) == batch.size  # masks stay per sample
    batch.rewards = torch.arange(batch.size, dtype=torch.float32) % 3
    adv = algo.advantages(ctx, batch).values
    w = 1.0 / t
    for g in group.unique():
        assert abs((adv[group == g] * w[group == g]).sum().item()) < 1e-5
    _, v1b, _ = algo.corrupt(StepContext(step=3, seed=7, adapter=model.adapter), batch, 0)
    assert not torch.equal(v1b.info["t"], t)  # a new step draws new levels
    _, per_sample, _ = _setup()[1].corrupt(ctx, batch, 0)
    assert len(set(per_sample.info["t"].tolist())) == batch.size  # default: one t per sample


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_estimate_at_half_is_half_of_full_view_plus_twice_the_coupled_view(family):
    model, algo, ctx = _setup(family, t_min=0.5, t_max=0.5)
    batch = rl_batch(n_prompts=2, group=2, gen_len=8, seed=3)
    views = algo.corrupt(ctx, batch, 0)
    value = algo.log_likelihood(ctx, model, batch, views).value
    P = batch.prompt_ids.shape[1]
    raw = []
    for v in views:  # plain per-view log-probs of the scored tokens, independent of the weights
        lp, _ = score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask)
        raw.append(lp[:, P:])
    l0, l1, l2 = raw
    in_v1 = views[1].info["v1"]
    lv = torch.where(in_v1, l1, l2)
    cmask = batch.completion_mask
    expected = (0.5 * (l0 + 2 * lv)) * cmask
    assert torch.allclose(value, expected, atol=1e-5)
    assert (value[cmask] != 0).all()


def test_leave_one_out_advantages():
    _, algo, ctx = _setup()
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.0, 1.0, 3.0, 1.0])
    batch = rl_batch(n_prompts=2, group=5, rewards=r)
    adv = algo.advantages(ctx, batch).values
    G = 5
    for g in range(2):
        rg, ag = r[g * G:(g + 1) * G], adv[g * G:(g + 1) * G]
        assert abs(ag.sum().item()) < 1e-6
        assert torch.allclose(ag, G / (G - 1) * (rg - rg.mean()))
        assert torch.allclose(ag, torch.stack([rg[i] - (rg.sum() - rg[i]) / (G - 1) for i in range(G)]))


@pytest.mark.parametrize("full_view,expected", [(True, 3), (False, 2)])
def test_forwards_per_iteration(full_view, expected):
    model, algo, ctx = _setup(full_mask_view=full_view)
    batch = rl_batch(n_prompts=1, group=3)
    rows = []
    handle = model.register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[0]))
    try:
        algo.log_likelihood(ctx, model, batch, algo.corrupt(ctx, batch, 0))
    finally:
        handle.remove()
    # every view of every sample is one forward row; the views run as one batch (dare.algorithms.base.score_views)
    assert sum(rows) == expected * batch.size and expected == algo.mc_samples
    assert len(rows) == 1


def test_masks_replay_across_passes_and_microbatches_without_touching_global_rng():
    _, algo, ctx = _setup()
    batch = rl_batch(n_prompts=3, group=2)
    state = torch.get_rng_state()
    a = algo.corrupt(ctx, batch, 0)
    assert torch.equal(torch.get_rng_state(), state)
    b = algo.corrupt(ctx, batch, 0)
    c = algo.corrupt(ctx, batch, 1)
    sub = algo.corrupt(ctx, batch.select([5, 0]), 0)
    for va, vb, vs in zip(a, b, sub):
        assert torch.equal(va.input_ids, vb.input_ids) and torch.equal(va.weight, vb.weight)
        assert torch.equal(vs.input_ids, va.input_ids[[5, 0]])
    assert not torch.equal(a[1].input_ids, c[1].input_ids)  # fresh noise per inner iteration
    other_step = StepContext(step=3, seed=7, adapter=ctx.adapter)
    assert not torch.equal(a[1].input_ids, algo.corrupt(other_step, batch, 0)[1].input_ids)


def _first_update_has_unit_ratio(model, algo, ctx, batch, prepare_micro_batch):
    """Old and train passes see identical masks, so at the first inner step the ratio is 1, nothing is clipped and
    the loss is the advantage-weighted token mean."""
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=prepare_micro_batch)
    ctx.norms = algo.normalizers(batch)
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and metrics["clip_frac"] == 0.0
    m = batch.completion_mask.float()
    assert metrics["loss"] == pytest.approx((-(m * batch.advantages.values[:, None]).sum() / m.sum()).item(), abs=1e-6)


def test_identical_masks_in_old_and_train_pass_give_unit_ratio_and_learn():
    model, algo, ctx = _setup(inner_iterations=2, beta=0.0)
    batch = rl_batch(n_prompts=2, group=3, seed=4)
    _first_update_has_unit_ratio(model, algo, ctx, batch, prepare_micro_batch=4)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_kl_to_identical_reference_is_zero():
    model, algo, ctx = _setup(inner_iterations=1)

    class SameRef:
        def scoring(self):
            return stages.frozen(model)

    batch = rl_batch(n_prompts=2, group=2, seed=5)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, reference=SameRef())
    ctx.norms = algo.normalizers(batch)
    assert stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)["kl"] == 0.0


# --- block-diffusion models: the pair per token within x_t, scored over [x_t ; x_0] ---------------------------------


def _block_setup(family="sdar", **cfg):
    model = block_model(family)
    return model, build_algorithm(CoupledGRPOConfig(**cfg)), StepContext(step=2, seed=7, adapter=model.adapter)


def test_block_views_partition_x_t_and_keep_the_clean_copy():
    model, algo, ctx = _block_setup()
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=1)
    views = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    W = P + 12
    masks = []
    for v in views:
        assert v.layout is not None and torch.equal(v.input_ids[:, W:], torch.cat([batch.prompt_ids, batch.completion_ids], 1))
        assert torch.equal(v.input_ids[:, :P], batch.prompt_ids)  # prompt never masked
        masks.append(v.input_ids[:, P:W] == mask_id)
    m0, m1, m2 = masks
    assert m0.all() and not (m1 & m2).any() and (m1 | m2).all()
    assert torch.equal(m1, views[1].info["v1"])


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_estimate_at_half_from_per_block_forwards(family):
    model, algo, ctx = _block_setup(family, t_min=0.5, t_max=0.5)
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=3)
    views = algo.corrupt(ctx, batch, 0)
    assert_matches_brute_force(model, batch, views)
    P = batch.prompt_ids.shape[1]
    l0, l1, l2 = (brute_force_logp(model, batch, v, 4)[:, P:] for v in views)
    lv = torch.where(views[1].info["v1"], l1, l2)
    cmask = batch.completion_mask
    value = algo.log_likelihood(ctx, model, batch, views).value
    assert torch.allclose(value, 0.5 * (l0 + 2 * lv) * cmask, atol=1e-5)


def test_block_terms_ignore_later_blocks():
    model, algo, ctx = _block_setup()
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=4)
    assert_future_blocks_invisible(model, batch, algo.corrupt(ctx, batch, 0))


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_ratio_is_one_at_first_inner_step(family):
    model, algo, ctx = _block_setup(family, inner_iterations=2, beta=0.0)
    batch = rl_batch(n_prompts=2, group=3, seed=5)
    _first_update_has_unit_ratio(model, algo, ctx, batch, prepare_micro_batch=2)


def test_config_rejects_bad_time_range():
    with pytest.raises(ValueError, match="t_min"):
        CoupledGRPOConfig(t_min=0.0)


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/coupled_grpo.yaml")
    assert isinstance(recipe.algorithm, CoupledGRPOConfig) and recipe.algorithm.full_mask_view


# `dare train` for 2 steps on every supported family: tests/algorithms/test_matrix.py.


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learns_a_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "coupled_grpo", family, "algorithm.beta=0.0")


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("coupled_grpo")
def loss_parity_coupled_grpo(algo, x, monkeypatch):
    """Coupled-GRPO's views (the reference's t and v1 mask), view combination and loss."""
    from dare.algorithms import coupled_grpo as module
    monkeypatch.setattr(module, "coupled_masks", lambda *a, **k: (x["v1"], x["t"]))
    views = leaf(x, "logp_views")  # all masked, t, 1 - t
    return estimator_and_loss(algo, case_batch(x), {"logp_views": views}, _hidden(x, list(views)))
