import math

import pytest
import torch

from dare.algorithms.cj_grpo import CJGRPOConfig
from dare.rollout.config import SamplerConfig
from dare.rollout.schedule import ass_split
from dare.trainer import stages
from tests.algorithms.helpers import corrupt, is_block_family, supported_families
from tests.algorithms.trajectory_helpers import learning_curve, replay_batch, rollout_batch, run_recipe, setup

ASS = dict(schedule="ass", eoser=True, eoser_gamma_min=0.01, temperature=1.0)


@pytest.mark.parametrize("ass_blocks", [1, 3])
def test_masked_replay_reproduces_the_rollout_states_and_ass_schedule(ass_blocks):
    """One block, and CJ-GRPO's multi-block ASS (block_num 3: blocks of 3, 4 and 9 tokens decoded by steps {0, 1},
    {2}, {3}): the replay states are the sampler's, |U_s| follows the ASS schedule, U_s lies in its block."""
    model, algo, ctx = setup(CJGRPOConfig())
    sampler = SamplerConfig(gen_length=16, block_length=16, block_stop=False, ass_blocks=ass_blocks, **ASS)
    batch, r = rollout_batch(model, sampler, n=3)
    views = corrupt(algo, ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    schedule = ass_split(16).tolist()  # 1, 2, 4, 9
    assert len(views) == len(schedule) == r.trajectory.states.shape[1]
    union = torch.zeros_like(batch.completion_ids, dtype=torch.long)
    for s, v in enumerate(views):
        state = v.input_ids[:, P:]
        u = v.targets[:, P:]
        assert torch.equal(state, r.trajectory.states[:, s])  # x^(s) is exactly the sampler's state
        assert (u.sum(1) == schedule[s]).all()  # |U_s| follows the ASS schedule
        # x^(s+1) = x^(s) with U_s filled in
        nxt = torch.where(u, batch.completion_ids, state)
        following = r.trajectory.states[:, s + 1] if s + 1 < len(views) else batch.completion_ids
        assert torch.equal(nxt, following)
        assert (state[u] == mask_id).all()
        if ass_blocks == 3:
            block = {0: (0, 3), 1: (0, 3), 2: (3, 7), 3: (7, 16)}[s]
            assert not u[:, :block[0]].any() and not u[:, block[1]:].any()
            assert (state[:, block[1]:] == mask_id).all()  # later blocks are untouched until their step
        union += u.long()
    assert (union == 1).all()  # U_s disjoint, union = the whole completion (post-EOS padding included)


def test_block_replay_runs_every_block_local_step_in_one_forward():
    model, algo, ctx = setup(CJGRPOConfig(), "sdar")
    B = model.adapter.block_size
    sampler = SamplerConfig(gen_length=12, block_length=B, block_stop=False, **ASS)
    batch, r = rollout_batch(model, sampler, prompts=("abcd", "hello!!!"), n=2)  # prompts fill whole blocks
    views = corrupt(algo, ctx, batch, 0)
    P, Lc = batch.prompt_ids.shape[1], 12
    steps = batch.step_map
    rounds = 0
    for i in range(steps.shape[0]):
        for blk in range(Lc // B):
            cols = slice(blk * B, (blk + 1) * B)
            local = torch.unique(steps[i, cols]).tolist()  # the block's global steps, in time order
            rounds = max(rounds, len(local))
            for j, s in enumerate(local):  # view j holds local step j of every block at once
                noisy = views[j].input_ids[i, P:P + Lc]
                assert torch.equal(noisy[cols], r.trajectory.states[i, s, cols])
                assert torch.equal(views[j].targets[i, P:][cols], steps[i, cols] == s)
            for j in range(len(local), len(views)):  # exhausted block: clean, no target
                assert not views[j].targets[i, P:][cols].any()
        n_steps = int(r.num_steps[i])
        assert batch.state.transition[i].max() == n_steps - 1  # CJ's step index = the row's global step
    assert len(views) == rounds and rounds >= len(ass_split(B))


def test_ratio_one_at_first_inner_step_and_per_step_token_mean():
    model, algo, ctx = setup(CJGRPOConfig(inner_iterations=2, beta=0.0))
    batch = replay_batch(False, seed=3, gen_len=8, steps=3)
    batch.step_map[0] = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2])  # uneven |U_s| across rows
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=4)
    ctx.norms = algo.normalizers(batch)
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    assert abs(m["ratio_mean"] - 1.0) < 1e-6 and m["clip_frac"] == 0.0
    # rho = 1: L = (1/S) sum_s sum_{k in U_s} (-A) / |U_s|
    adv = batch.advantages.values
    steps = batch.step_map
    expected = sum(-(adv[:, None].expand_as(steps)[steps == s]).sum() / (steps == s).sum() for s in range(3)) / 3
    assert abs(m["loss"] - expected.item()) < 1e-6
    assert torch.allclose(adv.view(2, 3).sum(1), torch.zeros(2), atol=1e-6)  # mean baseline


def test_step_merge_bounds_forwards_and_keeps_coverage():
    _, algo, ctx = setup(CJGRPOConfig(shrink=2))
    batch = replay_batch(False, seed=1, gen_len=12, steps=6)
    views = corrupt(algo, ctx, batch, 0)
    assert len(views) == 3
    P = batch.prompt_ids.shape[1]
    total = sum(v.targets[:, P:].long() for v in views)
    assert (total == 1).all()
    assert batch.state.transition.max() == 2


def test_transition_counts_are_global_normalisers():
    model, algo, ctx = setup(CJGRPOConfig(inner_iterations=1, beta=0.0))
    batch = replay_batch(False, seed=2, gen_len=8, steps=4)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    whole = stages.update(algo, ctx, model, batch, 0, micro_batch_size=6)["loss"]
    model.zero_grad()
    split = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)["loss"]
    assert abs(whole - split) < 1e-6  # micro-batching does not change the loss
    assert [ctx.norms[f"cj_transition_{j}"] for j in range(4)] == [float((batch.step_map == j).sum()) for j in range(4)]


@pytest.mark.parametrize("family", ["dream", "llada2_moe"])
def test_runs_on_both_attention_kinds(family):
    model, algo, ctx = setup(CJGRPOConfig(inner_iterations=1, beta=0.0), family)
    sampler = SamplerConfig(gen_length=8, block_length=8 if family == "dream" else model.adapter.block_size, **ASS)
    if family == "llada2_moe":
        sampler = SamplerConfig(gen_length=8, block_length=model.adapter.block_size, temperature=1.0, steps_per_block=4)
    batch, _ = rollout_batch(model, sampler)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    model.zero_grad()
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert abs(m["ratio_mean"] - 1.0) < 1e-6
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_deterministic_replay_is_scored_once_for_all_inner_iterations():
    model, algo, ctx = setup(CJGRPOConfig(inner_iterations=3, beta=0.0))
    batch = replay_batch(False, seed=2, gen_len=8, steps=4)
    calls = []
    original = algo.log_likelihood
    algo.log_likelihood = lambda *a, **k: calls.append(1) or original(*a, **k)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    assert batch.views[2] is batch.views[0]
    assert len(calls) == 1 and batch.old_logp[2] is batch.old_logp[0]


@pytest.mark.parametrize("family", supported_families("cj_grpo", fast=("llada",)))
def test_trains_end_to_end(tmp_path, family):
    extra = []
    if is_block_family(family):  # ASS inside every block of the model's block size
        extra = ["rollout.sampler={gen_length: 8, block_length: 4, schedule: ass, eoser: true, temperature: 1.0}"]
    hist = run_recipe(tmp_path, "cj_grpo", family, *extra)
    assert len(hist) == 2
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["nfe"] > 0 and "kl" in h


def test_trains_end_to_end_with_multi_block_ass(tmp_path):
    hist = run_recipe(tmp_path, "cj_grpo", "llada", "rollout.sampler.ass_blocks=2")
    assert len(hist) == 2
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["nfe"] == 4  # floor(log2 16) steps


@pytest.mark.integration
@pytest.mark.parametrize("ass_blocks", [1, 2])
def test_learns_a_toy_reward(tmp_path, ass_blocks):
    rewards = learning_curve(tmp_path, "cj_grpo", "llada", "algorithm.inner_iterations=1", "algorithm.beta=0.0",
                             "rollout.sampler={gen_length: 8, block_length: 8, schedule: ass, eoser: true, "
                             f"temperature: 1.0, block_stop: false, ass_blocks: {ass_blocks}}}",
                             steps=15 if ass_blocks == 1 else 20)  # 2 blocks: 5 of 8 tokens in one final step, slower
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards
