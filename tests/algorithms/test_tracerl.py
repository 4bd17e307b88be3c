import math

import pytest
import torch

from dare.algorithms.common.replay import INF_STEP, plan_replay, step_groups
from dare.algorithms.tracerl import TraceRLConfig
from dare.diffusion.logprob import score_targets
from dare.trainer import stages
from tests.algorithms.helpers import corrupt, is_block_family, supported_families
from tests.algorithms.trajectory_helpers import learning_curve, replay_batch, run_recipe, setup
from tests.trainer.two_processes import register, same_history, trajectory_case


def _prepared(algo, ctx, batch, model=None, micro=100):
    batch.advantages = algo.advantages(ctx, batch)
    if model is not None:
        stages.prepare(algo, ctx, batch, model, micro_batch_size=micro)
    else:
        batch.views = {0: corrupt(algo, ctx, batch, 0)}
    ctx.norms = algo.normalizers(batch)
    return batch


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("shrink", [1, 2, 3])
def test_targets_cover_response_once_and_are_masked_in_their_input(block, shrink):
    model, algo, ctx = setup(TraceRLConfig(shrink=shrink, post_tokens=None), "sdar" if block else "llada")
    batch = replay_batch(block, seed=shrink, gen_len=11)
    views = corrupt(algo, ctx, batch, 0)
    P = batch.prompt_ids.shape[1]
    mask_id = model.adapter.mask_token_id
    count = torch.zeros_like(batch.completion_ids)
    for v in views:
        tgt = v.targets[:, P:]
        assert not v.targets[:, :P].any()
        count += tgt.long()
        noisy = v.input_ids[:, P:P + tgt.shape[1]]  # full attention: the input; block: the noisy half
        assert (noisy[tgt] == mask_id).all()
        assert torch.equal(v.labels[:, P:], batch.completion_ids)
        if block:  # the clean half is the untouched sequence
            assert torch.equal(v.input_ids[:, v.targets.shape[1]:], v.labels)
    written = batch.step_map >= 0
    assert torch.equal(count, written.long())  # post_tokens=None: every written token, exactly once


def test_post_tokens_limit_targets_after_the_first_eos():
    model, algo, ctx = setup(TraceRLConfig(post_tokens=1))
    batch = replay_batch(False, seed=3, gen_len=10)
    corrupt(algo, ctx, batch, 0)
    n = batch.completion_mask.long().sum(1)
    is_target = batch.state.round >= 0
    allowed = torch.arange(10)[None] < (n[:, None] + 1)
    assert torch.equal(is_target, allowed & (batch.step_map >= 0))


@pytest.mark.parametrize("shrink", [1, 2, 3, 5, 8])
def test_shrink_k_gives_ceil_unique_over_k_forwards(shrink):
    steps = torch.tensor([[3, 0, 7, 7, 1, 4, 9, 2, 2, 5, 6, 8]])
    eligible = torch.ones_like(steps, dtype=torch.bool)
    plan = plan_replay(steps, eligible, shrink)
    assert plan.num_rounds == math.ceil(10 / shrink)
    # the state before group g masks exactly the tokens whose step is >= the group's first step
    uniq = sorted(set(steps[0].tolist()))
    for r in range(plan.num_rounds):
        first = uniq[r * shrink]
        assert torch.equal(plan.masked(r)[0], steps[0] >= first)
        assert torch.equal(plan.round[0] == r, (steps[0] >= first) & (steps[0] <= uniq[min(len(uniq) - 1, (r + 1) * shrink - 1)]))


def test_block_groups_collapse_within_each_block_and_never_written_stay_masked():
    steps = torch.tensor([[0, 1, 1, 2, 3, 3, 4, 5, -1, -1]])
    blocks = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2]])
    group, first = step_groups(steps, 2, blocks)
    assert group[0].tolist()[:8] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert first[0].tolist()[:8] == [0, 0, 0, 2, 3, 3, 3, 5]
    assert (group[0, 8:] == INF_STEP).all()
    plan = plan_replay(steps, steps >= 0, 2, blocks)
    assert plan.num_rounds == 2
    assert plan.masked(1)[0].tolist() == [False] * 3 + [True] + [False] * 3 + [True] * 3
    assert plan.transition[0].tolist() == [0, 0, 0, 1, 2, 2, 2, 3, -1, -1]


def test_block_view_future_noisy_block_does_not_change_earlier_logits():
    model, algo, ctx = setup(TraceRLConfig(shrink=1), "sdar")
    batch = replay_batch(True, seed=1, n_prompts=1, group=2, gen_len=12, prompt_lens=(4,))
    views = corrupt(algo, ctx, batch, 0)
    v = views[0]
    L = v.targets.shape[1]
    P = batch.prompt_ids.shape[1]
    blocks = batch.step_map.new_tensor((torch.arange(L) // 4).tolist())  # prompt of length 4: blocks from 0
    tgt = v.targets.clone()
    tgt[:, :P] = False
    tgt[:, P:] = True  # score every completion position of this state
    before, _ = score_targets(model, v.input_ids, tgt, v.labels, layout=v.layout)
    ids = v.input_ids.clone()
    later = (blocks >= 2) & (torch.arange(L) >= P)  # noisy blocks 2.. (completion blocks 1..)
    ids[:, :L][:, later] = 77
    after, _ = score_targets(model, ids, tgt, v.labels, layout=v.layout)
    early = (blocks < 2) & (torch.arange(L) >= P)
    assert torch.equal(before[:, early], after[:, early])
    assert not torch.allclose(before[:, later], after[:, later])
    # the clean copy of a noisy block's own block is invisible to it (no answer leak); earlier clean blocks are seen
    block1 = (blocks == 1) & (torch.arange(L) >= P)
    for clean_block, changes in ((1, False), (0, True)):
        ids = v.input_ids.clone()
        ids[:, L:][:, blocks == clean_block] = 77
        out, _ = score_targets(model, ids, tgt, v.labels, layout=v.layout)
        assert torch.equal(out[:, block1], before[:, block1]) != changes


def test_ratio_one_and_loss_is_round_mean_of_advantages():
    model, algo, ctx = setup(TraceRLConfig(inner_iterations=2, beta=0.0))
    batch = replay_batch(False, seed=4, gen_len=8)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    batch.completion_ids[:, -1] = 1  # every completion ends with EOS: nothing truncated
    _prepared(algo, ctx, batch, model, micro=4)
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    assert abs(m["ratio_mean"] - 1.0) < 1e-6 and m["clip_frac"] == 0.0
    # rho = 1: each (sample, round) row contributes -A, averaged over all rows
    rnd = batch.state.round
    rows = [(i, r) for i in range(6) for r in torch.unique(rnd[i][rnd[i] >= 0]).tolist()]
    expected = -sum(batch.advantages.values[i].item() for i, _ in rows) / len(rows)
    assert abs(m["loss"] - expected) < 1e-5
    z = (batch.rewards[:3] - batch.rewards[:3].mean()) / batch.rewards[:3].std(unbiased=False)
    assert torch.allclose(batch.advantages.values[:3], z)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_per_view_backward_equals_full_graph_gradient(family):
    block = family == "sdar"
    model, algo, ctx = setup(TraceRLConfig(beta=0.0, advantage="mean"), family)
    batch = replay_batch(block, seed=6, gen_len=9)
    batch.rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 1.0, 0.0])
    algo.config.truncated_reward = None
    _prepared(algo, ctx, batch)
    model.zero_grad()
    algo.backward(ctx, model, batch, 0)
    per_view = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    current = algo.log_likelihood(ctx, model, batch, batch.views[0])
    loss, _ = algo.loss(ctx, batch, current, 0)
    loss.backward()
    for a, p in zip(per_view, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in per_view)


def test_block_normalisation_divides_by_response_length():
    model, algo, ctx = setup(TraceRLConfig(beta=0.0, truncated_reward=None), "sdar")
    batch = replay_batch(True, seed=2, gen_len=8)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    _prepared(algo, ctx, batch)
    current = algo.log_likelihood(ctx, model, batch, batch.views[0])
    loss, _ = algo.loss(ctx, batch, current, 0)
    tgt = (batch.state.round >= 0).float()
    expected = -(tgt * batch.advantages.values[:, None]).sum() / (8 * ctx.norms["rounds"])
    assert abs(loss.item() - expected.item()) < 1e-6


def test_truncated_completions_get_the_truncated_reward():
    _, algo, ctx = setup(TraceRLConfig())
    batch = replay_batch(False, seed=3, gen_len=8)
    truncated = torch.tensor([True, False, True, False, False, False])
    batch.completion_ids[truncated] = 50  # no stop token anywhere
    batch.completion_mask[truncated] = True
    batch.completion_ids[~truncated, 5:] = 1  # EOS at position 5, then EOS padding
    batch.completion_mask[~truncated] = torch.arange(8)[None] <= 5
    batch.rewards = torch.ones(6)
    assert torch.equal(algo.advantage_rewards(ctx, batch), (~truncated).float())  # what the advantages are made of


def test_dream_logp_comes_from_the_previous_row():
    model, algo, ctx = setup(TraceRLConfig(), "dream")
    batch = replay_batch(False, seed=7, n_prompts=1, group=2, gen_len=6)
    v = corrupt(algo, ctx, batch, 0)[1]
    logp = algo.log_likelihood(ctx, model, batch, [v]).value
    P = batch.prompt_ids.shape[1]
    logits = model(v.input_ids, attention_mask=v.attention_mask).logits.float()
    ref = torch.log_softmax(logits, -1)
    tgt = v.targets[:, P:]
    i, k = tgt.nonzero(as_tuple=True)
    expected = ref[i, P + k - 1, batch.completion_ids[i, k]]
    assert torch.allclose(logp[i, k], expected, atol=1e-5)
    wrong = ref[i, P + k, batch.completion_ids[i, k]]
    assert not torch.allclose(logp[i, k], wrong, atol=1e-3)


def test_bad_input_errors():
    _, algo, ctx = setup(TraceRLConfig())
    batch = replay_batch(False)
    batch.step_map = None
    with pytest.raises(ValueError, match="step_map"):
        corrupt(algo, ctx, batch, 0)
    with pytest.raises(ValueError, match="shrink"):
        TraceRLConfig(shrink=0)


FAMILIES = supported_families("tracerl", fast=("sdar",))


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_end_to_end(tmp_path, family):
    extra = [] if is_block_family(family) else [
        "rollout.sampler={gen_length: 16, block_length: 16, steps: 16, temperature: 1.0}", "algorithm.shrink=4"]
    hist = run_recipe(tmp_path, "tracerl", family, *extra)
    assert len(hist) == 2
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["nfe"] > 0
        assert h["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # mu = 1: old := current


@pytest.mark.integration
def test_learns_a_toy_reward(tmp_path):
    rewards = learning_curve(tmp_path, "tracerl", "llada", "algorithm.shrink=8",
                             "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}")
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards


VARIABLE_STEPS = {  # threshold decoding: rows take very different numbers of steps, so ranks get different view counts
    "llada": "rollout.sampler={gen_length: 16, block_length: 16, steps: 16, threshold: 0.011, temperature: 1.0}",
    "sdar": "rollout.sampler={gen_length: 16, block_length: 4, steps_per_block: 4, remasking: dynamic, threshold: 0.011, "
            "temperature: 1.0}",
}


TWO_PROCESS = register({
    f"{algo}_{family}": trajectory_case(algo, f"model.path=tiny:{family}", "train.steps=2", "train.batch_size=4",
                                        "rollout.group_size=4", VARIABLE_STEPS[family], extra)
    for algo, family, extra in [("tracerl", "llada", "algorithm.shrink=1"),
                                ("cj_grpo", "llada", "algorithm.inner_iterations=2"),
                                ("dirl", "sdar", "algorithm.filter_zero_variance=false")]})


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TWO_PROCESS)
def test_two_processes_reproduce_one_process(two_process_runs, case):
    """Ranks hold samples with different numbers of rounds / steps: they agree on the number of views (FSDP) and
    the global normalisers make the 2-process losses equal the 1-process ones."""
    first, second = two_process_runs(case)
    one, two = first.metrics, second.metrics
    assert any(abs(a["loss"]) > 1e-6 for a in one)  # a real learning signal, not an all-zero loss
    # the same rollouts on 1 or 2 ranks
    assert len(one) == len(two) == 2 and all(a["completion_len"] == b["completion_len"] for a, b in zip(one, two))
    same_history(one, two, ("loss", "entropy", "grad_norm", "ratio_mean"))


def _rank_views(rank, world, port, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _, algo, ctx = setup(TraceRLConfig(), "llada")
        batch = replay_batch(False, seed=rank, n_prompts=1, group=2, gen_len=8, steps=3 + 2 * rank)
        out[rank] = (len(corrupt(algo, ctx, batch, 0)), int(batch.state.round.max()) + 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.multiprocess
def test_ranks_agree_on_the_number_of_views():
    """Rank 0's samples need 3 rounds, rank 1's 5: both run 5 views (FSDP needs the same forwards on every rank)."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank_views, args=(2, port, out), nprocs=2, join=True)
    assert out[0] == (5, 3) and out[1] == (5, 5)
