"""EGSPO / EGSPO-SA golden invariants (docs/algorithms/egspo.md): the entropy-guided step choice, the exact per-step
log-probability on the replayed state, the (stepwise) advantages from the one-step greedy denoise, ratio 1 before
the first update, the loss on hand-made inputs, and learning on the toy reward. The loss against the authors' code
is tests/algorithms/test_loss_parity.py (cases egspo, egspo_sa)."""
import math

import pytest
import torch

from dare.algorithms.base import lend_modules
from dare.algorithms import LogLik, build_algorithm
from dare.algorithms.egspo import (EGSPOConfig, EGSPOSAConfig, greedy_denoise, replay_state, select_steps,
                                   step_entropies, stepwise_advantages)
from dare.rollout.config import Record, SamplerConfig
from dare.trainer import stages
from tests.algorithms.helpers import corrupt
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.trajectory_helpers import rollout_batch, run_recipe, setup
from dare.algorithms import StepContext
from tests.algorithms.parity_io import TableModel, completion_hidden, stub_adapter
from tests.algorithms.test_loss_parity import case_batch, leaf, runner

SAMPLER = dict(gen_length=8, block_length=8, steps=8, temperature=1.0, block_stop=False)


def _batch(model, n=3, rewards=None, **sampler):
    cfg = SamplerConfig(**{**SAMPLER, **sampler})
    batch, r = rollout_batch(model, cfg, n=n, rewards=rewards, record=Record(trajectory=True, entropy=True))
    batch.entropy_map = r.entropy_map
    return batch, r


# --- step selection ----------------------------------------------------------------------------------------------


def test_step_entropy_is_the_mean_over_the_tokens_the_step_committed():
    step_map = torch.tensor([[0, 1, 1, 2, -1], [1, 0, 0, 0, 1]])
    ent = torch.tensor([[1.0, 2.0, 4.0, 0.5, 9.0], [3.0, 1.0, 2.0, 6.0, 5.0]])
    h, valid = step_entropies(step_map, ent)
    assert torch.allclose(h, torch.tensor([[1.0, 3.0, 0.5], [3.0, 4.0, 0.0]]))  # never-written token (9.0) ignored
    assert valid.tolist() == [[True, True, True], [True, True, False]]  # row 1 took two steps


def test_selected_steps_are_the_k_highest_entropy_ones_in_descending_order():
    h = torch.tensor([[0.3, 0.9, 0.1, 0.9, 0.5], [2.0, 1.0, 3.0, 0.0, 0.0]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    assert select_steps(h, valid, 3).tolist() == [[1, 3, 4], [2, 0, 1]]  # ties: the earlier step first
    assert select_steps(h, valid, 4).tolist() == [[1, 3, 4, 0], [2, 0, 1, -1]]  # a row with fewer steps pads -1
    # the reference's ablations: k - 1 steps in time order plus the last one
    assert select_steps(h, valid, 3, "uniform").tolist() == [[0, 3, 4], [0, 1, 2]]  # linspace(0, n - 2, k - 1)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    rnd = select_steps(h, valid, 3, "random", gens)
    assert rnd[:, -1].tolist() == [4, 2] and (rnd[0, :2] < 4).all() and (rnd[1, :2] < 2).all()


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_prepare_picks_each_rows_highest_entropy_steps_of_its_rollout(family):
    model, algo, ctx = setup(EGSPOConfig(sample_train_steps=3, inner_iterations=1), family)
    batch, r = _batch(model, block_length=4 if family == "sdar" else 8)
    state = algo.prepare(ctx, batch)
    for b in range(batch.size):
        sm, em = r.step_map[b], r.entropy_map[b]
        per_step = {t: float(em[sm == t].mean()) for t in sm[sm >= 0].unique().tolist()}
        best = sorted(per_step, key=lambda t: -per_step[t])[:3]
        assert state.steps[b].tolist() == best
        assert torch.allclose(state.entropy[b], torch.tensor([per_step[t] for t in best]))


# --- the per-step likelihood ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_step_logp_equals_a_direct_forward_on_the_replayed_state_at_the_committed_positions(family):
    model, algo, ctx = setup(EGSPOConfig(sample_train_steps=4, inner_iterations=2), family)
    batch, r = _batch(model, block_length=4 if family == "sdar" else 8)
    views = corrupt(algo, ctx, batch, 1)
    got = algo.log_likelihood(ctx, model, batch, views).value  # [B, 2]: slots 2 and 3
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    for j, k in enumerate(algo.slots(1)):
        for b in range(batch.size):
            t = int(batch.state.steps[b, k])
            state = r.trajectory.states[b, t]  # the sampler's own state before the row's step t
            assert torch.equal(replay_state(batch.completion_ids[b:b + 1], batch.step_map[b:b + 1],
                                            torch.tensor([t]), mask_id)[0][0], state)
            ids = torch.cat([batch.prompt_ids[b], state])[None]
            attn = torch.cat([batch.prompt_mask[b], torch.ones_like(state, dtype=torch.bool)])[None]
            with torch.no_grad():
                logp = model.adapter.prediction_logits(model(ids, attention_mask=attn).logits).float().log_softmax(-1)[0]
            committed = (batch.step_map[b] == t).nonzero().flatten()
            assert committed.numel() >= 1
            direct = sum(float(logp[P + i, batch.completion_ids[b, i]]) for i in committed.tolist())
            assert abs(float(got[b, j].detach()) - direct) < 1e-4, (family, b, t)


# --- advantages ------------------------------------------------------------------------------------------------------


def test_lambda_zero_gives_the_group_centred_terminal_reward_in_every_slot():
    R = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.2, 0.8])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    r = torch.rand(6, 4)
    want = (R - torch.tensor([0.5] * 3 + [0.4] * 3))[:, None].expand(6, 4)
    assert torch.allclose(stepwise_advantages(R, None, groups, 4), want)
    assert torch.allclose(stepwise_advantages(R, r, groups, 4, lambda1=0.0), want)


def test_stepwise_returns_follow_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    R, r = torch.rand(6, generator=g), torch.rand(6, 3, generator=g)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    lam = 0.5
    G = (R[:, None] + lam * (R[:, None] - r)) / (1 + lam)
    mean = torch.cat([G[:3].mean(0, keepdim=True).expand(3, 3), G[3:].mean(0, keepdim=True).expand(3, 3)])
    a = stepwise_advantages(R, r, groups, 3, lam, normalize=True)
    assert torch.allclose(a, G - mean, atol=1e-6)
    assert torch.allclose(a.view(2, 3, 3).sum(1), torch.zeros(2, 3), atol=1e-6)  # centred per slot
    same = stepwise_advantages(R, R[:, None].expand(6, 3), groups, 3, lam)  # r = R: the terminal advantage / (1+l)
    assert torch.allclose(same, stepwise_advantages(R, None, groups, 3) / (1 + lam), atol=1e-6)
    raw = stepwise_advantages(R, r, groups, 3, lam, normalize=False)
    assert torch.allclose(raw, (1 + lam) * (G - mean), atol=1e-6)
    std = stepwise_advantages(R, r, groups, 3, lam, centre_stepwise=False)  # standard_grpo_returns
    assert torch.allclose(std, (stepwise_advantages(R, None, groups, 3) + lam * (R[:, None] - r)) / (1 + lam), atol=1e-6)


def test_sa_rewards_the_one_step_greedy_denoise_of_each_trained_state():
    model, algo, ctx = setup(EGSPOSAConfig(sample_train_steps=2, inner_iterations=1, lambda1=0.5))
    batch, r = _batch(model, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5]))
    calls = []

    def score(batch, ids, rows):
        calls.append((ids.clone(), rows.clone()))
        return (ids == 7).float().mean(1) + 0.01 * rows.float()

    ctx.services.score_completions = score
    batch.state = algo.prepare(ctx, batch)
    batch.views = {0: algo.corrupt(ctx, batch, 0)}
    batch.frozen = algo.score_frozen(ctx, batch, lend_modules(policy=model), micro_batch_size=4)
    (ids, rows), = calls
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    for n, (b, k) in enumerate(zip(rows.tolist(), [0, 1] * batch.size)):
        state = r.trajectory.states[b, int(batch.state.steps[b, k])]
        x = torch.cat([batch.prompt_ids[b], state])[None]
        attn = torch.cat([batch.prompt_mask[b], torch.ones_like(state, dtype=torch.bool)])[None]
        with torch.no_grad():
            logits = model(x, attention_mask=attn).logits.float()[0, P:]
        logits[:, mask_id] = float("-inf")
        want = torch.where(state == mask_id, logits.argmax(-1), state)  # argmax everywhere, committed tokens kept
        assert torch.equal(ids[n], want)
        assert abs(float(batch.frozen.rewards[b, k]) - float(score(None, want[None], torch.tensor([b]))[0])) < 1e-6
    adv = algo.advantages(ctx, batch).values
    assert torch.allclose(adv, stepwise_advantages(batch.rewards, batch.frozen.rewards, batch.group, 2, 0.5))


def test_greedy_denoise_keeps_committed_tokens_and_never_predicts_the_mask():
    model, algo, ctx = setup(EGSPOConfig(sample_train_steps=1, inner_iterations=1))
    batch, _ = _batch(model)
    batch.state = algo.prepare(ctx, batch)
    (view,) = algo.corrupt(ctx, batch, 0)
    mask_id, Lc = model.adapter.mask_token_id, batch.completion_ids.shape[1]
    x0 = greedy_denoise(model, view, Lc, mask_id)
    state = view.input_ids[:, -Lc:]
    assert torch.equal(x0[state != mask_id], state[state != mask_id]) and not (x0 == mask_id).any()


# --- loss ----------------------------------------------------------------------------------------------------------


def _prepared(algo, ctx, model, batch):
    stages.prepare(algo, ctx, batch, model, None, micro_batch_size=4)
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)


def test_ratio_is_one_before_the_first_update_and_the_loss_is_the_formula():
    model, algo, ctx = setup(EGSPOConfig(sample_train_steps=4, inner_iterations=2, beta=0.0))
    batch, _ = _batch(model, steps=4)  # 2 tokens per step
    _prepared(algo, ctx, model, batch)
    assert ctx.norms["committed_tokens"] / ctx.norms["denoise_steps"] == 2.0
    model.zero_grad()
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac"] == 0.0
    adv = batch.advantages.values[:, :2]  # iteration 0 trains slots 0 and 1
    assert m["loss"] == pytest.approx(float(-adv.sum() / (2.0 * 2 * batch.size)), abs=1e-6)
    # one backward per slot == one backward of the whole iteration's loss
    per_slot = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss, _ = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, batch.views[0]), 0)
    loss.backward()
    for a, p in zip(per_slot, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4)


def test_clipping_and_kl_on_hand_made_step_log_probs():
    model, algo, ctx = setup(EGSPOConfig(sample_train_steps=2, inner_iterations=2, beta=0.04))  # one slot per update
    batch, _ = _batch(model, n=2, steps=4, rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]))
    batch.state = algo.prepare(ctx, batch)
    batch.views = {0: algo.corrupt(ctx, batch, 0)}
    batch.advantages = algo.advantages(ctx, batch)  # +-0.5
    ctx.norms = algo.normalizers(batch)
    old, ref = torch.full((4, 1), -2.0), torch.full((4, 1), -1.5)
    batch.old_logp, batch.ref_logp = {0: old}, {0: ref}
    logp = torch.tensor([[-1.0], [-2.0], [-2.2], [-2.5]], requires_grad=True)
    loss, m = algo.loss(ctx, batch, LogLik(logp), 0)
    loss.backward()
    A = batch.advantages.values[:, :1]
    rho = torch.exp(logp.detach() - old)
    surr = -torch.minimum(rho * A, rho.clamp(0.8, 1.5) * A)
    d = ref - logp.detach()
    kl = torch.exp(d) - d - 1  # k3 on the step-level log-probability
    n, pairs = 2.0, 4
    assert float(loss) == pytest.approx(float((surr + 0.04 * kl).sum() / (n * pairs)), rel=1e-5)
    assert float(A[0, 0]) > 0 and float(rho[0, 0]) > 1.5  # clipped: only the KL's gradient remains
    assert float(logp.grad[0, 0]) == pytest.approx(float(0.04 * (1 - torch.exp(d[0, 0])) / (n * pairs)), rel=1e-5)
    assert m["clip_frac"] == pytest.approx(0.25) and m["kl"] > 0


# --- configuration and errors -------------------------------------------------------------------------------------


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by inner_iterations"):
        EGSPOConfig(sample_train_steps=3, inner_iterations=2)
    model, algo, ctx = setup(EGSPOConfig(sample_train_steps=2, inner_iterations=1))
    batch, _ = _batch(model)
    batch.entropy_map = None
    with pytest.raises(ValueError, match="carries no entropy map"):
        algo.prepare(ctx, batch)
    assert algo.record == Record(entropy=True)  # what its rollouts record, asked by the method itself
    assert build_algorithm(EGSPOConfig(step_selection="random")).record == Record(entropy=True)  # still logged
    _, sa, sa_ctx = setup(EGSPOSAConfig(), "sdar")
    with pytest.raises(ValueError, match="x0_hat"):  # the trainer's start-up check names why
        sa.check_model(sa_ctx.adapter)


@pytest.mark.parametrize("name,family", [("egspo", "llada"), ("egspo", "sdar"), ("egspo_sa", "llada")])
def test_trains_end_to_end(tmp_path, name, family):
    block = 4 if family == "sdar" else 8
    hist = run_recipe(tmp_path, name, family, "rollout.sampler.gen_length=8", f"rollout.sampler.block_length={block}",
                      "rollout.sampler.steps=8")
    assert len(hist) == 2
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["nfe"] > 0
        assert h["step_entropy_rollout"] > 0 and ("step_reward" in h) == (name == "egspo_sa")


@pytest.mark.integration
@pytest.mark.parametrize("name,family", [("egspo", "llada"), ("egspo_sa", "llada")])
def test_learns_the_toy_reward(tmp_path, name, family):
    """Without the KL to the frozen start (beta 0): at the toy's lr (3e-3) the k3 penalty of the step log-probs holds
    the policy back, and EGSPO-SA's stepwise term (the greedy fills of a random model score far above its samples)
    is noise the 15 steps do not average out. Measured over train.seed 0-3 (docs/algorithms/egspo.md): beta 0 rises
    +0.66..+0.77 (egspo) and +0.36..+0.68 (egspo_sa); beta 0.04 +0.25..+0.44 (egspo), -0.00..+0.32 (egspo_sa)."""
    learns_toy_reward(tmp_path, name, family, "algorithm.sample_train_steps=4", "algorithm.inner_iterations=2",
                      "algorithm.beta=0.0",
                      sampler="{gen_length: 8, block_length: 8, steps: 8, temperature: 1.0, block_stop: false}")


def test_attention_kinds():
    from dare.algorithms import get_algorithm
    assert get_algorithm("egspo").supports == ("bidirectional", "block_causal")
    assert get_algorithm("egspo_sa").supports == ("bidirectional",)
    assert {"encoder_decoder"} <= set(get_algorithm("egspo").undefined)
    assert {"encoder_decoder", "block_causal"} <= set(get_algorithm("egspo_sa").undefined)


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("egspo")
def loss_parity_egspo(algo, x, monkeypatch):
    """EGSPO / EGSPO-SA: the trained steps from the recorded entropies (must be the reference's), the replayed states,
    the one-step-denoise rewards (the case's greedy completion of each state; the argmax has its own golden test),
    the advantages, and each iteration's loss from dare's estimator on the embedded leaf."""
    from dare.algorithms import egspo as module
    B, T1, Lc = x["states"].shape
    P = x["prompt_ids"].shape[1]

    def greedy(model, view, completion_length, mask_id):  # the case's x0_hat of each row's state
        rows = []
        for ids in view.input_ids:
            hit = ((x["states"] == ids[P:]).all(-1) & (x["prompt_ids"] == ids[:P]).all(-1)[:, None]).nonzero()
            assert hit.shape[0] == 1
            rows.append(x["greedy"][hit[0, 0], hit[0, 1]])
        return torch.stack(rows)

    monkeypatch.setattr(module, "greedy_denoise", greedy)
    reward_of = {(b, tuple(x["greedy"][b, t].tolist())): float(x["greedy_rewards"][b, t]) for b in range(B) for t in range(T1)}
    batch = case_batch(x, step_map=x["step_map"], entropy_map=x["entropy_map"])
    ctx = StepContext(step=0, seed=0, adapter=stub_adapter())
    ctx.services.score_completions = lambda batch, ids, rows: torch.tensor(
        [reward_of[(int(r), tuple(i.tolist()))] for i, r in zip(ids, rows)])
    batch.state = algo.prepare(ctx, batch)
    assert torch.equal(batch.state.steps, x["eval_time_steps"])  # the reference's entropy-guided choice
    n_it = algo.inner_iterations
    batch.views = {j: algo.corrupt(ctx, batch, j) for j in range(n_it)}
    if algo.frozen_models:
        batch.frozen = algo.score_frozen(ctx, batch, lend_modules(policy=None), B)
    for j in range(n_it):
        for k, view in zip(algo.slots(j), batch.views[j]):  # the replayed state of every row's step
            steps = batch.state.steps[:, k]
            assert torch.equal(view.input_ids[:, P:], x["states"][torch.arange(B), steps])
    slots = [list(algo.slots(j)) for j in range(n_it)]
    batch.old_logp = {j: x["old_logp"][s].T.double() for j, s in enumerate(slots)}
    batch.ref_logp = {j: x["ref_logp"][s].T.double() for j, s in enumerate(slots)}
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    logp = leaf(x, "logp_steps")  # [T, B, Lc]
    steps = batch.state.steps
    tables = [completion_hidden(logp[steps[:, k], torch.arange(B)], P, x["completion_ids"])
              for s in slots for k in s]  # dare's forwards in order: iteration by iteration, slot by slot
    model = TableModel(tables)
    total = 0.0
    for j in range(n_it):
        current = algo.log_likelihood(ctx, model, batch, batch.views[j])
        total = total + algo.loss(ctx, batch, current, j)[0]
    return total, {"logp_steps": logp}
