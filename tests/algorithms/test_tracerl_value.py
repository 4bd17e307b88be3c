"""TraceRL's optional diffusion value model (``algorithm.value_model: true``; ``dare.algorithms.value``)."""
import math

import pytest
import torch

from dare.algorithms.base import lend_modules
from dare.algorithms.tracerl import TraceRLConfig
from dare.algorithms.losses import clipped_value_loss
from dare.algorithms.value import ValueModel, trace_returns_advantages
from dare.models import LogitsRequest
from dare.trainer import stages
from tests.algorithms.helpers import is_block_family, supported_families
from tests.algorithms.trajectory_helpers import learning_curve, replay_batch, run_recipe, setup
from tests.trainer.two_processes import register, same_history, trajectory_case


def reference_gae(reward, values, steps, gamma, lam):
    """``compute_returns_and_advantages_from_fragments`` (train_sdar_value.py) for one sequence, restated with
    plain Python loops: ``steps`` = each trained token's trace step, ``values`` its old value."""
    uniq = sorted(set(steps))
    S = len(uniq)
    rank = {s: i for i, s in enumerate(uniq)}
    last = uniq[-1]
    r_tok = [reward if s == last else 0.0 for s in steps]
    r_star = [sum(r for r, s in zip(r_tok, steps) if s == u) / steps.count(u) for u in uniq]
    v_star = [sum(v for v, s in zip(values, steps) if s == u) / steps.count(u) for u in uniq]
    R, A = [0.0] * S, [0.0] * S
    for i in range(S - 1, -1, -1):
        R[i] = r_star[i] + (gamma * R[i + 1] if i + 1 < S else 0.0)
        v_next = v_star[i + 1] if i + 1 < S else 0.0
        A[i] = r_star[i] - v_star[i] + gamma * v_next + (gamma * lam * A[i + 1] if i + 1 < S else 0.0)
    ret, adv = [], []
    for r, v, s in zip(r_tok, values, steps):
        i = rank[s]
        nxt = i + 1 < S
        ret.append(r + gamma * (R[i + 1] if nxt else 0.0))
        adv.append(r - v + gamma * (v_star[i + 1] if nxt else 0.0) + gamma * lam * (A[i + 1] if nxt else 0.0))
    return ret, adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.0), (0.9, 0.95), (0.5, 0.3)])
def test_returns_and_advantages_match_the_reference_loops(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, L = 4, 9
    rank = torch.randint(0, 4, (B, L), generator=g)
    rank[1] = torch.randint(0, 2, (L,), generator=g)  # fewer steps than the batch's widest row
    rank[2, :3] = -1  # tokens that are not trained
    rank[3] = -1  # a row without targets
    values = torch.randn(B, L, generator=g)
    rewards = torch.tensor([1.3, -0.4, 0.7, 2.0])
    returns, adv = trace_returns_advantages(rewards, values, rank, gamma, lam)
    for i in range(B):
        keep = rank[i] >= 0
        assert (returns[i][~keep] == 0).all() and (adv[i][~keep] == 0).all()
        if not keep.any():
            continue
        ret, a = reference_gae(rewards[i].item(), values[i][keep].tolist(), rank[i][keep].tolist(), gamma, lam)
        assert torch.allclose(returns[i][keep], torch.tensor(ret), atol=1e-5)
        assert torch.allclose(adv[i][keep], torch.tensor(a), atol=1e-5)
    if gamma == lam == 1.0:  # the configs: token-wise baseline, R_j = r, A_j = r - V_j (the reference's assertion 1)
        keep = rank >= 0
        assert torch.allclose(returns[keep], rewards[:, None].expand(B, L)[keep])
        assert torch.allclose(adv[keep], (rewards[:, None] - values)[keep], atol=1e-6)


def test_clipped_value_loss():
    v = torch.tensor([0.5, 0.5, -0.1, 0.05])
    old = torch.tensor([0.0, 0.0, 0.0, 0.0])
    R = torch.tensor([1.0, -1.0, 0.3, 0.0])
    loss, clipped = clipped_value_loss(v, old, R, 0.2)
    # v_clip = [0.2, 0.2, -0.1, 0.05]: 0.5 * max((v - R)^2, (v_clip - R)^2)
    assert torch.allclose(loss, torch.tensor([0.5 * 0.8 ** 2, 0.5 * 1.5 ** 2, 0.5 * 0.4 ** 2, 0.5 * 0.05 ** 2]))
    assert clipped.tolist() == [True, False, False, False]
    assert torch.allclose(clipped_value_loss(v, old, R, None)[0], 0.5 * (v - R) ** 2)


def _prepared(family="sdar", **cfg):
    model, algo, ctx = setup(TraceRLConfig(value_model=True, truncated_reward=None, **cfg), family)
    vm = ValueModel.from_policy(model)
    ctx.companions = {"value": vm}
    batch = replay_batch(family == "sdar", seed=3, gen_len=9)
    batch.rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 1.0, 0.0])
    stages.prepare(algo, ctx, batch, model, micro_batch_size=4)
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    return model, vm, algo, ctx, batch


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_zero_initialised_value_model_starts_as_plain_tracerl(family):
    """V = 0 at the start: A_j = r (the plain TraceRL advantage) and the value loss is the weighted 0.5 r^2."""
    model, vm, algo, ctx, batch = _prepared(family, beta=0.0)
    tgt = algo.targets(batch)
    assert (batch.frozen.values == 0).all()
    z = algo.advantages(ctx, batch.select(torch.arange(batch.size))).values  # recomputed on a copy
    plain = TraceRLConfig(truncated_reward=None).advantage
    assert plain == "mean_std"
    zs = (batch.rewards.view(2, 3) - batch.rewards.view(2, 3).mean(1, keepdim=True))
    zs = (zs / batch.rewards.view(2, 3).std(1, unbiased=False, keepdim=True)).flatten()
    assert torch.allclose(z[tgt], zs[:, None].expand_as(z)[tgt], atol=1e-6)
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    w, _ = algo.token_weights(ctx, batch)
    expected_policy = -(w * zs[:, None]).sum()
    assert m["loss"] == pytest.approx(float(expected_policy), abs=1e-6)
    assert m["value_loss"] == pytest.approx(float((w * 0.5 * zs[:, None] ** 2).sum()), abs=1e-6)
    assert vm.value_head.weight.grad is not None and vm.value_head.weight.grad.abs().sum() > 0


def test_old_values_are_read_in_each_tokens_own_replay_state():
    model, vm, algo, ctx, batch = _prepared("sdar")
    with torch.no_grad():
        vm.value_head.weight.normal_()
        batch.frozen = algo.score_frozen(ctx, batch, lend_modules(value=vm), 100)
        P = batch.prompt_ids.shape[1]
        for r, view in enumerate(batch.views[0]):
            hidden = vm.lm(view.input_ids, layout=view.layout, request=LogitsRequest.hidden_states()).hidden_states
            own = batch.state.round == r
            expected = (hidden[:, P:P + own.shape[1]] @ vm.value_head.weight[0])
            assert torch.allclose(batch.frozen.values[own], expected[own], atol=1e-5)
        assert (batch.frozen.values != 0).any()


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_per_view_value_backward_equals_the_full_graph_gradient(family):
    model, vm, algo, ctx, batch = _prepared(family)
    with torch.no_grad():
        vm.value_head.weight.normal_(std=0.1)
        batch.frozen = algo.score_frozen(ctx, batch, lend_modules(value=vm), 100)
        batch.advantages = algo.advantages(ctx, batch)
    vm.zero_grad()
    algo.value_backward(ctx, batch, 1.0)
    per_view = [p.grad.clone() if p.grad is not None else None for p in vm.parameters()]
    vm.zero_grad()
    from dare.algorithms.value import view_values
    values = torch.zeros_like(batch.frozen.values)
    for r, view in enumerate(batch.views[0]):
        values = torch.where(batch.state.round == r, view_values(vm, view), values)
    w, _ = algo.token_weights(ctx, batch)
    tgt = algo.targets(batch)
    loss, _ = clipped_value_loss(torch.where(tgt, values, batch.frozen.values), batch.frozen.values, batch.advantages.returns, 0.2)
    (loss * w * tgt).sum().backward()
    for a, p in zip(per_view, vm.parameters()):
        if a is None:
            assert p.grad is None or p.grad.abs().sum() == 0
        else:
            assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4)
    assert per_view[-1].abs().sum() > 0  # the value head learns


FAMILIES = supported_families("tracerl", fast=("sdar", "llada"))


def _masked_extra(family):
    return [] if is_block_family(family) else [
        "rollout.sampler={gen_length: 16, block_length: 16, steps: 16, temperature: 1.0}", "algorithm.shrink=4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_end_to_end(tmp_path, family):
    hist = run_recipe(tmp_path, "tracerl_with_value", family, *_masked_extra(family), "optim.lr=1e-3",
                      "algorithm.value_lr=1e-2", steps=3)
    assert len(hist) == 3
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["value_loss"]) and math.isfinite(h["value_grad_norm"])
        assert h["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert hist[0]["value_mean"] == 0.0  # the zero-initialised head
    if family in ("sdar", "llada"):  # these runs see non-constant rewards: the value model learns from the first step
        assert all(h["value_grad_norm"] > 0 for h in hist) and hist[-1]["value_mean"] != 0.0


def test_value_model_is_checkpointed_and_resumes_exactly(tmp_path):
    args = ("optim.lr=1e-3", "algorithm.value_lr=1e-2")
    straight = run_recipe(tmp_path / "a", "tracerl_with_value", "sdar", *args, steps=3)
    run_recipe(tmp_path / "b", "tracerl_with_value", "sdar", *args, "train.save_every=1", steps=1)
    resumed = run_recipe(tmp_path / "b", "tracerl_with_value", "sdar", *args, "train.resume=auto", steps=3)
    assert len(resumed) == 2
    for a, b in zip(straight[1:], resumed):
        for key in ("loss", "value_loss", "value_mean", "value_grad_norm", "reward_mean"):
            assert a[key] == b[key], key


@pytest.mark.integration
def test_learns_a_toy_reward(tmp_path):
    rewards = learning_curve(tmp_path, "tracerl_with_value", "llada", "algorithm.shrink=8", "algorithm.value_lr=3e-3",
                             "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}")
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


TWO_PROCESS = register({"tracerl_value_sdar": trajectory_case(
    "tracerl_with_value", "model.path=tiny:sdar", "train.steps=2", "train.batch_size=4", "rollout.group_size=4",
    "rollout.sampler={gen_length: 16, block_length: 4, steps_per_block: 4, remasking: dynamic, "
    "threshold: 0.011, temperature: 1.0}", "algorithm.value_lr=1e-2")})


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TWO_PROCESS)
def test_two_processes_reproduce_one_process(two_process_runs, case):
    first, second = two_process_runs(case)
    assert any(abs(a["value_loss"]) > 1e-6 for a in first.metrics)
    same_history(first.metrics, second.metrics, ("loss", "value_loss", "value_mean", "value_grad_norm", "grad_norm"))
