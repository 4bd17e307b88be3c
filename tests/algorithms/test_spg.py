import math

import pytest
import torch

from dare.algorithms import LogLik, StepContext, build_algorithm
from dare.algorithms.common.scoring import score_view
from dare.algorithms.spg import SPGConfig, spg_bounds
from dare.trainer.recipe import load_recipe
from dare.diffusion.logprob import score_targets
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.block_checks import (assert_future_blocks_invisible, assert_matches_brute_force, block_model,
                                           brute_force_logp, row_blocks)
from tests.algorithms.helpers import rl_batch
# shared tiny `dare train` runners and the autouse one-thread fixture
from tests.algorithms.toy_task import ROOT, learns_toy_reward, one_thread  # noqa: F401
from tests.algorithms.test_loss_parity import _hidden, case_batch, estimator_and_loss, leaf, runner


def _setup(family="llada", **cfg):
    cfg.setdefault("block_length", 4)
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo = build_algorithm(SPGConfig(**cfg))
    return model, algo, StepContext(step=5, seed=2, adapter=model.adapter)


def _prepared(algo, ctx, model, batch):
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    return batch


def test_block_random_mask_structure():
    model, algo, ctx = _setup(p_mask_prompt=0.0, num_t=3, min_t=0.25, max_t=0.75)
    batch = rl_batch(n_prompts=4, group=3, gen_len=16, seed=1)
    P, mask_id, bl = batch.prompt_ids.shape[1], model.adapter.mask_token_id, 4
    valid = batch.completion_mask
    views = algo.corrupt(ctx, batch, 0)
    for i in range(batch.size):
        L = int(valid[i].sum())
        n_blocks = math.ceil(L / bl)
        chosen = [int(v.info["block"][i]) for v in views]
        assert all(0 <= b < n_blocks for b in chosen)
        assert len(set(chosen)) == min(3, n_blocks)  # draws spread over distinct blocks
        for v, b in zip(views, chosen):
            masked = v.input_ids[i, P:] == mask_id
            assert torch.equal(v.input_ids[i, :P], batch.prompt_ids[i])  # p_mask_prompt = 0: prompt clean
            assert not masked[:b * bl].any()  # earlier blocks clean
            end = min((b + 1) * bl, L)
            n = end - b * bl
            m = int(masked[b * bl:end].sum())
            assert max(int(n * 0.25), 1) <= m <= max(min(int(n * 0.75), n), 1)  # partial mask of b*
            assert masked[end:].all()  # later blocks and post-EOS fully masked
            assert torch.equal(v.targets[i, P:], masked & valid[i])


def test_prompt_and_earlier_blocks_masked_with_p():
    model, algo, ctx = _setup(p_mask_prompt=0.5, num_t=1)
    batch = rl_batch(n_prompts=20, group=2, prompt_lens=(30, 40), gen_len=16, seed=2)
    (v,) = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    pm = v.info["prompt_masked"]
    assert not pm[~batch.prompt_mask].any()
    frac = pm[batch.prompt_mask].float().mean().item()
    assert abs(frac - 0.5) < 0.06
    earlier = [(v.input_ids[i, P:P + 4 * int(v.info["block"][i])] == mask_id) for i in range(batch.size)]
    earlier = torch.cat(earlier)
    assert earlier.numel() > 20 and 0.3 < earlier.float().mean().item() < 0.7


def test_p_one_masks_all_context_but_leaves_the_chosen_block_partial():
    model, algo, ctx = _setup(p_mask_prompt=1.0, num_t=2, min_t=0.25, max_t=0.25)
    batch = rl_batch(n_prompts=3, group=2, gen_len=16, seed=8)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    for v in algo.corrupt(ctx, batch, 0):
        assert torch.equal(v.info["prompt_masked"], batch.prompt_mask)
        for i in range(batch.size):
            b, L = int(v.info["block"][i]), int(batch.completion_mask[i].sum())
            masked = v.input_ids[i, P:] == mask_id
            end = min(4 * b + 4, L)
            assert masked[:4 * b].all() and masked[end:].all()
            assert int(masked[4 * b:end].sum()) == max(int((end - 4 * b) * 0.25), 1)


@pytest.mark.parametrize("forward_type", ["all", "random", "block_all"])
def test_other_forward_types(forward_type):
    model, algo, ctx = _setup(p_mask_prompt=0.0, num_t=1, forward_type=forward_type)
    batch = rl_batch(n_prompts=3, group=2, gen_len=12, seed=3)
    (v,) = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    masked = v.input_ids[:, P:] == mask_id
    valid = batch.completion_mask
    assert masked[~valid].all() and (masked & valid).any(-1).all()
    if forward_type == "all":
        assert masked.all()
    if forward_type == "block_all":
        for i in range(batch.size):
            b = int(v.info["block"][i])
            assert not masked[i, :4 * b].any() and masked[i, 4 * b:].all()


def test_eubo_minus_elbo_is_minus_log_t_over_beta_with_one_draw():
    model, algo, ctx = _setup(num_t=1, logp_estimation="eubo", eubo_beta=1.5)
    batch = rl_batch(n_prompts=3, group=2, gen_len=16, seed=4)
    views = algo.corrupt(ctx, batch, 0)
    value = algo.log_likelihood(ctx, model, batch, views).value
    elbo, eubo = value[:, 0], value[:, 1]
    t_hat = views[0].info["t_hat"]
    assert torch.allclose(eubo - elbo, -torch.log(t_hat) / 1.5, atol=1e-5)
    assert (eubo - elbo >= 0).all()
    # ELBO = mean log-prob over the masked scored tokens (no 1/t)
    v = views[0]
    lp, _ = score_targets(model, v.input_ids, v.targets, v.labels, attention_mask=v.attention_mask)
    assert torch.allclose(elbo, (lp * v.targets).sum(-1) / v.targets.sum(-1), atol=1e-6)


def test_bounds_with_several_draws_match_probability_space_formula():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 2, 6, generator=g) * 3
    scored = torch.rand(3, 2, 6, generator=g) < 0.5
    valid = torch.ones(2, 6, dtype=torch.bool)
    elbo, eubo = spg_bounds(logp, scored, valid, 2.0)
    t = scored.sum(-1).float() / 6
    q = (logp.exp() ** 2 * scored / t[..., None]).mean(0)  # reference: mean_j p^beta 1[masked] / t_j
    hit = q > 0
    ref_eubo = torch.stack([q[b][hit[b]].log().mean() / 2.0 for b in range(2)])
    assert torch.allclose(eubo, ref_eubo, atol=1e-5)
    ref_elbo = ((logp * scored).sum(-1) / scored.sum(-1)).mean(0)
    assert torch.allclose(elbo, ref_elbo, atol=1e-6)


def test_mix_is_weighted_eubo_and_elbo():
    model, algo_mix, ctx = _setup(num_t=2, logp_estimation="mix", mix_weight=0.3)
    algo_eubo = build_algorithm(SPGConfig(num_t=2, block_length=4, logp_estimation="eubo"))
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=5)
    views = algo_mix.corrupt(ctx, batch, 0)
    mix = algo_mix.log_likelihood(ctx, model, batch, views).value
    pure = algo_eubo.log_likelihood(ctx, model, batch, views).value
    assert torch.allclose(mix[:, 0], pure[:, 0])
    assert torch.allclose(mix[:, 1], 0.3 * pure[:, 1] + 0.7 * pure[:, 0], atol=1e-6)


def test_routing_by_advantage_sign_and_length_weighting():
    model, algo, ctx = _setup()
    batch = rl_batch(n_prompts=2, group=3, seed=6, rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.5]))
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    value = torch.randn(batch.size, 2, requires_grad=True)
    loss, metrics = algo.loss(ctx, batch, LogLik(value), 0)
    loss.backward()
    adv = batch.advantages.values
    assert metrics["positive_frac"] == pytest.approx((adv > 0).float().mean().item())  # A = 0 goes to the bound
    lens = batch.completion_mask.sum(-1).float()
    coef = -adv * lens / lens.sum()
    pos = adv > 0
    assert torch.allclose(value.grad[:, 0], torch.where(pos, coef, torch.zeros_like(coef)))
    assert torch.allclose(value.grad[:, 1], torch.where(pos, torch.zeros_like(coef), coef))
    assert pos.any() and (~pos).any()


def test_zero_advantage_gives_zero_gradient():
    model, algo, ctx = _setup(inner_iterations=1)
    batch = _prepared(algo, ctx, model, rl_batch(n_prompts=2, group=2, rewards=torch.tensor([1.0, 1.0, 0.0, 0.0])))
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert metrics["loss"] == 0.0
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in model.parameters())


def test_update_learns_and_needs_no_old_or_reference_pass():
    model, algo, ctx = _setup(inner_iterations=4)
    assert not algo.needs_old_logp and not algo.needs_reference
    batch = _prepared(algo, ctx, model, rl_batch(n_prompts=2, group=2, seed=7, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0])))
    assert batch.old_logp is None and len(batch.views) == 4
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert math.isfinite(metrics["loss"]) and metrics["positive_frac"] == 0.5
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_noise_replays_and_differs_across_iterations():
    _, algo, ctx = _setup()
    batch = rl_batch(n_prompts=3, group=2, gen_len=16)
    a, b, c = (algo.corrupt(ctx, batch, it) for it in (0, 0, 1))
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    assert not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
    sub = algo.corrupt(ctx, batch.select([3, 1]), 0)
    assert all(torch.equal(s.input_ids, x.input_ids[[3, 1]]) for s, x in zip(sub, a))


def test_kl_rejected():
    with pytest.raises(ValueError, match="beta"):
        SPGConfig(beta=0.01)


# --- block-diffusion models: the model's own blocks, per-token bounds over [x_t ; x_0] ------------------------------


def _block_setup(family="sdar", **cfg):
    cfg.setdefault("block_length", 32)  # ignored on block models: the model's block size (4 here) is used
    model = block_model(family)
    return model, build_algorithm(SPGConfig(**cfg)), StepContext(step=5, seed=2, adapter=model.adapter)


def test_block_random_uses_the_model_blocks_over_absolute_positions():
    model, algo, ctx = _block_setup(p_mask_prompt=0.0, num_t=3, min_t=0.25, max_t=0.75)
    batch = rl_batch(n_prompts=4, group=2, prompt_lens=(5, 7), gen_len=14, seed=1)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    W = P + 14
    valid = batch.completion_mask
    views = algo.corrupt(ctx, batch, 0)
    for i in range(batch.size):
        L = int(valid[i].sum())
        spans = [(s - P, min(e - P, L)) for s, e in row_blocks(batch, i, 4) if s - P < L]
        assert spans[0][1] - spans[0][0] < 4 or int(batch.prompt_mask[i].sum()) % 4 == 0  # shares the prompt block
        chosen = [int(v.info["block"][i]) for v in views]
        assert len(set(chosen)) == min(3, len(spans))
        for v, b in zip(views, chosen):
            start, end = spans[b]
            masked = v.input_ids[i, P:W] == mask_id
            assert not masked[:start].any() and masked[end:].all()
            n = end - start
            assert max(int(n * 0.25), 1) <= int(masked[start:end].sum()) <= max(min(int(n * 0.75), n), 1)
            assert torch.equal(v.targets[i, P:], masked & valid[i])
            assert torch.equal(v.input_ids[i, W + P:], batch.completion_ids[i])  # the clean copy


def test_block_masked_prompt_fills_both_halves_and_earlier_blocks_only_x_t():
    model, algo, ctx = _block_setup(p_mask_prompt=0.5, num_t=1)
    batch = rl_batch(n_prompts=6, group=2, prompt_lens=(20, 30), gen_len=16, seed=2)
    (v,) = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    W = P + 16
    assert v.info["prompt_masked"].any()
    assert torch.equal(v.input_ids[:, :P], v.input_ids[:, W:W + P])
    assert torch.equal(v.input_ids[:, :P] == mask_id, v.info["prompt_masked"])
    assert torch.equal(v.input_ids[:, W + P:], batch.completion_ids)  # clean prefix for every block
    earlier = [v.input_ids[i, P:row_blocks(batch, i, 4)[int(v.info["block"][i])][0]] == mask_id for i in range(batch.size)]
    earlier = torch.cat(earlier)
    assert earlier.numel() > 10 and 0.2 < earlier.float().mean().item() < 0.8  # p-masked (and scored) in x_t


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_bounds_from_per_block_forwards(family):
    model, algo, ctx = _block_setup(family, num_t=2, p_mask_prompt=0.15)
    batch = rl_batch(n_prompts=2, group=2, gen_len=14, seed=3)
    views = algo.corrupt(ctx, batch, 0)
    assert_matches_brute_force(model, batch, views)
    P = batch.prompt_ids.shape[1]
    logp = torch.stack([brute_force_logp(model, batch, v, 4)[:, P:] for v in views])
    scored = torch.stack([v.targets[:, P:] for v in views])
    elbo, eubo = spg_bounds(logp, scored, batch.completion_mask, algo.config.eubo_beta)
    value = algo.log_likelihood(ctx, model, batch, views).value
    assert torch.allclose(value[:, 0], elbo, atol=1e-5)
    assert torch.allclose(value[:, 1], 0.5 * eubo + 0.5 * elbo, atol=1e-5)


def test_block_eubo_minus_elbo_with_one_draw():
    model, algo, ctx = _block_setup(num_t=1, logp_estimation="eubo", eubo_beta=1.5)
    batch = rl_batch(n_prompts=3, group=2, gen_len=16, seed=4)
    views = algo.corrupt(ctx, batch, 0)
    value = algo.log_likelihood(ctx, model, batch, views).value
    assert torch.allclose(value[:, 1] - value[:, 0], -torch.log(views[0].info["t_hat"]) / 1.5, atol=1e-5)


def test_block_terms_ignore_later_blocks():
    model, algo, ctx = _block_setup(num_t=2, p_mask_prompt=0.0)
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=5)
    assert_future_blocks_invisible(model, batch, algo.corrupt(ctx, batch, 0))


def test_block_update_learns_without_old_or_reference_pass():
    model, algo, ctx = _block_setup("llada2", inner_iterations=2, num_t=2)
    batch = _prepared(algo, ctx, model, rl_batch(n_prompts=2, group=2, seed=7, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0])))
    a, b = (algo.log_likelihood(ctx, model, batch, batch.views[0]).value for _ in range(2))
    assert torch.equal(a, b)  # the stored noise replays exactly (no ratio to check: SPG has none)
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert math.isfinite(metrics["loss"]) and metrics["positive_frac"] == 0.5
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("family", ["llada", "llada2"])
def test_draws_are_scored_in_one_forward_with_the_per_draw_gradient(family, monkeypatch):
    """The num_t draws of a micro-batch run as one forward: draws in separate forwards of one graph hold each
    layer's gradient until the last draw's backward (under FSDP2 the unsharded gradients of every layer at once:
    32.5 GiB per GPU for LLaDA2.0-mini, dare plan). The gradient is the per-draw graph's, up to float rounding."""
    import dare.algorithms.spg as spg
    model, algo, ctx = (_setup(num_t=3) if family == "llada" else _block_setup(family, num_t=3))
    batch = _prepared(algo, ctx, model, rl_batch(n_prompts=2, group=2, seed=7, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0])))
    calls = []
    handle = model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    batched = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    handle.remove()
    assert len(calls) == 2  # one forward per micro-batch, not one per draw
    one = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(spg, "score_views", lambda m, views, chunk: [score_view(m, v, chunk) for v in views])
    separate = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    each = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert batched["loss"] == pytest.approx(separate["loss"], rel=1e-6)
    assert len(one) == len(each) and any(g.abs().sum() > 0 for g in one)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(one, each))


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/spg.yaml")
    assert isinstance(recipe.algorithm, SPGConfig) and recipe.algorithm.num_t == 16


# `dare train` for 2 steps on every supported family: tests/algorithms/test_matrix.py.


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learns_a_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "spg", family, "algorithm.num_t=2", "algorithm.inner_iterations=2")


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("spg")
def loss_parity_spg(algo, x, monkeypatch):
    """SPG's draws (the reference's prompt / completion masks), bounds and loss."""
    from dare.algorithms import spg as module
    J = x["completion_masked"].shape[0]
    none = torch.full((x["completion_ids"].shape[0],), -1)
    monkeypatch.setattr(module, "spg_masks", lambda *a, **k: [(x["prompt_masked"][j], x["completion_masked"][j], none)
                                                             for j in range(J)])
    draws = leaf(x, "logp_draws")
    return estimator_and_loss(algo, case_batch(x), {"logp_draws": draws}, _hidden(x, list(draws)))
