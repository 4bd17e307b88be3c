import dataclasses
import math

import pytest
import torch

from dare.algorithms.advantages import group_zscore_unbiased
from dare.algorithms.mdpo import MDPOConfig, step_advantages_raw, top_steps
from dare.rollout.config import Record, SamplerConfig
from dare.trainer import stages
from tests.algorithms.helpers import corrupt, plain_services, supported_families
from tests.algorithms.trajectory_helpers import learning_curve, rollout_batch, run_recipe, setup
from tests.trainer.two_processes import register, trajectory_case
from dare.algorithms import LogLik, StepContext
from tests.algorithms.parity_io import stub_adapter
from tests.algorithms.test_loss_parity import case_batch, leaf, runner


def test_step_advantage_formula_on_a_hand_made_reward_sequence():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    a = step_advantages_raw(r)
    # a_s = (r_s - r_{s-1}) + 1 + mean_{u>s} r_u, r_{-1} = 0, last step + r_{T-1}
    assert torch.allclose(a[0], torch.tensor([1 + 2 / 3, 2.5, 1.0, 0.0]))
    assert torch.allclose(a[1], torch.tensor([3.0, 2.0, 2.0, 2.0]))


def test_per_step_group_zscore_uses_the_unbiased_std_and_eps():
    a = torch.tensor([[1.0, 5.0], [3.0, 5.0], [2.0, 0.0], [4.0, 1.0]])
    groups = torch.tensor([0, 0, 1, 1])
    z = group_zscore_unbiased(a, groups, 1e-4)
    g0 = a[:2, 0]
    assert torch.allclose(z[:2, 0], (g0 - g0.mean()) / (g0.std() + 1e-4))
    assert torch.equal(z[:2, 1], torch.zeros(2))  # constant column: 0, not NaN
    assert torch.equal(group_zscore_unbiased(a[:1], groups[:1], 1e-4), torch.zeros(1, 2))  # group of one


def test_top_k_steps_by_summed_absolute_advantage():
    adv = torch.tensor([[0.1, -2.0, 0.5, 0.0], [0.1, 1.0, -1.0, 3.0]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    assert top_steps(adv, valid, 2) == [1, 3]  # |.| sums: 0.2, 3.0, 1.5, 3.0 -> ties keep the earlier step first
    valid[1, 3] = False  # a step only one row took counts for that row only
    assert top_steps(adv, valid, 2) == [1, 2]
    assert top_steps(adv, valid, 9) == [1, 2, 0, 3]


def _scorer(target_token):
    calls = []

    def score(batch, completion_ids, rows):
        calls.append((completion_ids.clone(), rows.clone()))
        return (completion_ids == target_token).float().mean(1) + 0.1 * rows.float()

    return score, calls


def _mdpo_batch(model, ctx, steps=4, gen=8, n=3, rcr=False):
    sampler = SamplerConfig(gen_length=gen, block_length=gen, steps=steps, temperature=1.0, rcr=rcr, block_stop=False)
    batch, r = rollout_batch(model, sampler, n=n)
    t = r.trajectory
    batch.trajectory = t
    score, calls = _scorer(target_token=int(batch.completion_ids[0, 0]))
    ctx.services.score_completions = score
    return batch, r, calls


def test_views_replay_the_selected_states_with_predictions_as_labels():
    model, algo, ctx = setup(MDPOConfig(sample_train_steps=2))
    batch, r, calls = _mdpo_batch(model, ctx)
    views = corrupt(algo, ctx, batch, 0)
    t = r.trajectory
    B, S, Lc = t.states.shape
    # every valid step's prediction was scored once, with the row it belongs to
    assert calls[0][0].shape == (int(t.valid.sum()), Lc)
    assert torch.equal(batch.state.step_rewards[:, 0], (t.x0[:, 0] == int(batch.completion_ids[0, 0])).float().mean(1)
                       + 0.1 * torch.arange(B).float())
    steps = batch.state.steps
    assert steps == top_steps(batch.state.step_advantages, t.valid, 2)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    for v, s in zip(views, steps):
        assert torch.equal(v.input_ids[:, P:], t.states[:, s])
        assert torch.equal(v.targets[:, P:], t.states[:, s] == mask_id)
        assert torch.equal(v.labels[:, P:], t.x0[:, s])
        assert torch.equal(v.info["confidence"], t.confidence[:, s])
    adv = algo.advantages(ctx, batch).values
    assert torch.equal(adv, batch.state.step_advantages[:, steps])


def test_lambda_times_masked_count_is_the_generation_length():
    model, algo, ctx = setup(MDPOConfig(sample_train_steps=4))
    batch, _, _ = _mdpo_batch(model, ctx, steps=4, gen=8)
    views = corrupt(algo, ctx, batch, 0)
    tgt, lam, _, _ = algo._slot_tensors(batch, views)
    n = tgt.view(tgt.shape[0], len(views), 8).float().sum(-1)
    lam_slot = lam.view(tgt.shape[0], len(views), 8)[..., 0]
    assert (n > 0).all()
    assert torch.allclose(lam_slot * n, torch.full_like(n, 8.0), rtol=1e-4)


def test_ratio_one_loss_and_per_step_backward_match_the_formula():
    model, algo, ctx = setup(MDPOConfig(sample_train_steps=3))
    batch, _, _ = _mdpo_batch(model, ctx, steps=4, gen=8)
    batch.advantages = None
    stages.prepare(algo, ctx, batch, model)
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    views = batch.views[0]
    tgt, lam, conf, count = algo._slot_tensors(batch, views)
    k, Lc = len(views), 8
    adv = batch.advantages.values.repeat_interleave(Lc, dim=1)
    # the reference's per-sample step loss (token sum / (its masked count + 1e-4)), mean over the samples
    expected = (-adv * lam * conf * tgt / (count + 1e-4)).sum() / batch.size
    model.zero_grad()
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert abs(m["ratio_mean"] - 1.0) < 1e-6 and m["clip_frac"] == 0.0
    assert abs(m["loss"] - expected.item()) < 1e-5
    per_step = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss, _ = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, views), 0)
    loss.backward()
    for a, p in zip(per_step, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4)


def test_dream_scores_each_target_from_the_previous_row_at_the_temperature():
    model, algo, ctx = setup(MDPOConfig(sample_train_steps=1, temperature=0.5), "dream")
    batch, _, _ = _mdpo_batch(model, ctx, steps=4, gen=8, n=2)
    (v,) = corrupt(algo, ctx, batch, 0)
    logp = algo.log_likelihood(ctx, model, batch, [v]).value
    P = batch.prompt_ids.shape[1]
    logits = model(v.input_ids, attention_mask=v.attention_mask).logits.float() / 0.5
    ref = torch.log_softmax(logits, -1)
    i, k = v.targets[:, P:].nonzero(as_tuple=True)
    assert i.numel() > 0
    assert torch.allclose(logp[i, k], ref[i, P + k - 1, v.labels[i, P + k]], atol=1e-5)
    assert not torch.allclose(logp[i, k], ref[i, P + k, v.labels[i, P + k]], atol=1e-3)


def test_rcr_rollouts_train_and_confidences_are_running():
    model, algo, ctx = setup(MDPOConfig(sample_train_steps=2))
    batch, r, _ = _mdpo_batch(model, ctx, steps=4, gen=8, rcr=True)
    stages.prepare(algo, ctx, batch, model)  # the loop's order: state and views, then the advantages
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    model.zero_grad()
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert m["loss"] == m["loss"] and ctx.norms["targets"] > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_errors_name_the_fix():
    model, algo, ctx = setup(MDPOConfig())
    batch, _, _ = _mdpo_batch(model, ctx)
    batch.trajectory = None
    with pytest.raises(ValueError, match="no recorded trajectory"):
        corrupt(algo, ctx, batch, 0)
    assert algo.record == Record(trajectory=True)  # the method asks its rollouts for it
    sampler = SamplerConfig(gen_length=8, block_length=4, steps=4, temperature=1.0)
    batch, r = rollout_batch(model, sampler)
    t = r.trajectory
    batch.trajectory = t
    with pytest.raises(ValueError, match="single-block"):
        corrupt(algo, ctx, batch, 0)
    _, block_algo, block_ctx = setup(MDPOConfig(), "sdar")
    with pytest.raises(ValueError, match="bidirectional"):  # the trainer's start-up check
        block_algo.check_model(block_ctx.adapter)
    ctx.services.score_completions = None
    with pytest.raises(ValueError, match="score_completions"):
        corrupt(algo, ctx, batch, 0)


def test_block_sampler_steps_leave_later_blocks_unpredicted_so_block_models_are_rejected():
    """Why MDPO stays masked-only: a block model's step predicts its own block only, so the whole-answer prediction
    x0^(s) that MDPO rewards does not exist before the last block."""
    model, algo, ctx = setup(MDPOConfig(), "sdar")
    assert algo.supports == ("bidirectional",)
    sampler = SamplerConfig(gen_length=8, block_length=4, steps=8, temperature=1.0, block_stop=False)
    batch, r = rollout_batch(model, sampler)
    t, mask_id = r.trajectory, model.adapter.mask_token_id
    unpredicted = (t.x0 == mask_id) & (t.confidence == 0)  # [N, S, G]: masked and never looked at by the step
    assert unpredicted[:, 0, -1].all()  # the first step never predicts the last block
    first_full = (~unpredicted.any(-1)).float().argmax(1)  # first step whose prediction covers the whole answer
    assert (first_full > 0).all() and (t.valid.sum(1) > first_full).all()
    batch.trajectory = t
    with pytest.raises(ValueError, match="bidirectional"):  # the trainer's start-up check
        algo.check_model(ctx.adapter)


@pytest.mark.parametrize("family", supported_families("mdpo", fast=("llada",)))
def test_trains_end_to_end(tmp_path, family):
    hist = run_recipe(tmp_path, "mdpo", family)
    assert len(hist) == 2
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["nfe"] > 0
        assert h["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.integration
def test_learns_a_toy_reward(tmp_path):
    rewards = learning_curve(tmp_path, "mdpo", "llada", "algorithm.temperature=1.0", "algorithm.sample_train_steps=4",
                             "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0, "
                             "block_stop: false}")
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards


# --- ICFW curation ("incremental_training") ---------------------------------------------------------------------


def test_answer_backslide_keeps_intermediate_correct_final_wrong():
    from dare.algorithms.mdpo import answer_backslide
    step_correct = torch.tensor([[0, 1, 0], [0, 0, 1], [0, 0, 0], [1, 0, 0], [0, 0, 1]]).bool()
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]]).bool()  # rows 3, 4 took 2 steps
    final = torch.tensor([0, 1, 0, 0, 0]).bool()
    # row 0: backslide; 1: correct at the end; 2: never correct; 3: backslide; 4: its "correct" step is padding
    assert answer_backslide(step_correct, valid, final).tolist() == [True, False, False, True, False]


def _stop_cut_parity(ids, stops):
    """1.0 when the token ids of the completion (cut before its first stop token) have an odd sum."""
    out = []
    for row in ids.tolist():
        n = next((k for k, t in enumerate(row) if t in stops), len(row))
        out.append(float(sum(row[:n]) % 2))
    return torch.tensor(out)


def test_icfw_selects_the_prompts_whose_rollout_backslides():
    model, algo, ctx = setup(MDPOConfig(icfw=True, icfw_temperature=1.0))
    sampler = SamplerConfig(gen_length=8, block_length=8, steps=4, temperature=0.1, block_stop=False)
    calls = []

    def score_ids(ids, examples, stops):
        calls.append(len(examples))
        return _stop_cut_parity(ids, set(stops))

    ctx.services = plain_services(rollout_sampler=sampler, score_ids=score_ids)
    from dare.data.prompts import PromptedExample
    from dare.models import tiny_tokenizer
    tok = tiny_tokenizer()
    prompts = [PromptedExample({"task": "toy"}, f"puzzle {i}", tok.encode(f"puzzle {i}")) for i in range(12)]
    uids = list(range(100, 112))
    kept = algo.select_prompts(ctx, model, prompts, uids)
    # brute force: the same rollout (greedy settings of icfw, the trainer's keyed seeds), every step scored
    from dare.diffusion.noise import STREAM_ROLLOUT, derive_seed
    from dare.rollout import generate
    cfg = dataclasses.replace(sampler, temperature=1.0)
    expected = []
    for j, (p, u) in enumerate(zip(prompts, uids)):
        r = generate(model, [p.input_ids], cfg, seeds=[derive_seed(ctx.seed, STREAM_ROLLOUT, "icfw", ctx.step, u)],
                     record=Record(trajectory=True))
        stops = set(r.stop_token_ids)
        steps = [bool(_stop_cut_parity(r.trajectory.x0[0, s:s + 1], stops)[0]) for s in range(int(r.num_steps[0]))]
        if any(steps) and not bool(_stop_cut_parity(r.completion_ids, stops)[0]):
            expected.append(j)
    assert kept == expected and 0 < len(kept) < len(prompts)
    assert calls[0] == 12  # the final answers, then every recorded step of every rollout
    assert sum(calls[1:]) == 12 * 4


def _icfw_run(tmp_path, *extra, steps=3):
    from dare.rewards import REWARDS, register_reward
    if "icfw_odd_length" not in REWARDS:
        register_reward("icfw_odd_length")(_odd_length)
    return run_recipe(tmp_path, "mdpo", "llada", "reward.name=icfw_odd_length", "algorithm.icfw=true",
                      "algorithm.icfw_temperature=1.0", *extra, steps=steps)


def _odd_length(completion, example):
    return float(len(completion) % 2)


def test_icfw_trains_on_the_selected_pool_and_resumes_with_it(tmp_path, monkeypatch):
    from dare.trainer.rl import PromptSource
    seen = []
    real = PromptSource.batch

    def spy(self, step):
        out = real(self, step)
        allowed = {tuple(self.prompted[i].input_ids) for i in (self.pool or [])}
        seen.append((len(self.pool or []), all(tuple(t) in allowed for t in out["prompt_tokens"])))
        return out

    monkeypatch.setattr(PromptSource, "batch", spy)
    hist = _icfw_run(tmp_path / "a")
    n = hist[0]["curated_prompts"]
    assert 0 < n < 8  # some of the 8 prompts backslide, not all
    assert seen and all(size == n and inside for size, inside in seen[:int(-(-n // 2))])  # one pass over the pool
    # resume from a checkpoint taken inside the pool's pass: the same pool, the same losses
    _icfw_run(tmp_path / "b", "train.save_every=1", steps=1)
    resumed = _icfw_run(tmp_path / "b", "train.resume=auto")
    assert [h["loss"] for h in resumed] == [h["loss"] for h in hist[1:]]
    assert [h.get("curated_prompts") for h in resumed] == [h.get("curated_prompts") for h in hist[1:]]


TWO_PROCESS = register({"mdpo_icfw_llada": trajectory_case(
    "mdpo", "train.steps=2", "train.batch_size=4", "rollout.group_size=4", "algorithm.icfw=true",
    "algorithm.icfw_temperature=1.0", "algorithm.icfw_correct=0.04")})


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TWO_PROCESS)
def test_icfw_two_processes_select_the_same_pool_as_one(two_process_runs, case):
    """Each rank tests half of the prompts (model gathered once for decoding); the pools are merged by an all-reduce."""
    first, second = two_process_runs(case)
    one, two = first.metrics, second.metrics
    assert one[0]["curated_prompts"] == two[0]["curated_prompts"] > 0
    # Step 1 trains on the same prompts of the pool, so it has the same rollouts. (MDPO's update itself differs with
    # the number of ranks -- each rank picks its own top steps, docs/algorithms/mdpo.md -- so later steps differ.)
    a, b = one[0], two[0]
    assert a["reward_mean"] == b["reward_mean"] and a["completion_len"] == b["completion_len"], (a, b)


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("mdpo")
def loss_parity_mdpo(algo, x, monkeypatch):
    """MDPO's step rewards -> step advantages, top-step selection, per-step views (targets, 1/t, confidence), loss."""
    from dare.rollout import Trajectory
    B, S = x["step_rewards"].shape
    trajectory = Trajectory(x["states"], x["x0"], x["confidence"], torch.full((B,), S), torch.ones(B, S, dtype=torch.bool))
    batch = case_batch(x, trajectory=trajectory)
    ctx = StepContext(step=0, seed=0, adapter=stub_adapter())
    # the case's rewards of every (sample, step) prediction, in the order MDPO asks for them (all steps valid)
    ctx.services.score_completions = lambda batch, ids, rows: x["step_rewards"].reshape(-1)
    batch.views = {0: corrupt(algo, ctx, batch, 0)}
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    steps = batch.state.steps  # dare's choice; each slot scores one step
    logp = leaf(x, "logp_steps")
    batch.ref_logp = {0: torch.cat([x["ref_logp"][s] for s in steps], dim=1)}
    current = LogLik(torch.cat([logp[s] for s in steps], dim=1))
    return algo.loss(ctx, batch, current, 0)[0], {"logp_steps": logp}
