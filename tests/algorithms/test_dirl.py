import math

import pytest
import torch

from dare.algorithms.dirl import DiRLConfig
from dare.trainer import stages
from tests.algorithms.helpers import corrupt
from tests.algorithms.trajectory_helpers import replay_batch, run_recipe, setup


def _ready(algo, ctx, batch):
    batch.advantages = algo.advantages(ctx, batch)
    batch.views = {0: corrupt(algo, ctx, batch, 0)}
    ctx.norms = algo.normalizers(batch)
    return batch


def test_block_models_only():
    _, algo, ctx = setup(DiRLConfig(), "llada")
    with pytest.raises(ValueError, match="block_causal"):  # the trainer's start-up check
        algo.check_model(ctx.adapter)
    assert algo.needs_reference and not algo.needs_old_logp  # KL to the reference; mu = 1


def test_targets_are_a_subset_of_the_masked_tokens():
    model, algo, ctx = setup(DiRLConfig(), "sdar")
    batch = replay_batch(True, seed=5, gen_len=12)
    P = batch.prompt_ids.shape[1]
    for v in corrupt(algo, ctx, batch, 0):
        noisy = v.input_ids[:, P:P + 12]
        assert (noisy[v.targets[:, P:]] == model.adapter.mask_token_id).all()


def test_dummy_rounds_contribute_nothing():
    model, algo, ctx = setup(DiRLConfig(beta=0.0, filter_zero_variance=False), "sdar")
    batch = replay_batch(True, seed=0, n_prompts=1, group=2, gen_len=8, prompt_lens=(4,))
    batch.step_map = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1],  # one step per block: 1 round
                                      [0, 1, 2, 3, 4, 5, 6, 7]])  # four steps per block: 4 rounds
    batch.rewards = torch.tensor([1.0, 0.0])
    _ready(algo, ctx, batch)
    assert len(batch.views[0]) == 4
    assert not any(v.targets[0].any() for v in batch.views[0][1:])  # rounds 2-4 of sample 0 are dummies
    norms = dict(ctx.norms)
    model.zero_grad()
    together = algo.backward(ctx, model, batch, 0)["loss"]
    grad_together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apart = 0.0
    for i in (0, 1):  # each sample on its own (sample 0 then has a single view), same global normalisers
        part = batch.select([i])
        part.views = {0: corrupt(algo, ctx, part, 0)}
        ctx.norms = norms
        apart += algo.backward(ctx, model, part, 0)["loss"]
    assert len(part.views[0]) == 4 and abs(together - apart) < 1e-6
    for a, p in zip(grad_together, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4)


def test_token_mean_and_asymmetric_clip():
    model, algo, ctx = setup(DiRLConfig(beta=0.0, inner_iterations=2, filter_zero_variance=False), "sdar")
    batch = replay_batch(True, seed=1, gen_len=8)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    _ready(algo, ctx, batch)
    current = algo.log_likelihood(ctx, model, batch, batch.views[0])
    tgt = (batch.state.round >= 0).float()
    adv = batch.advantages.values[:, None]
    # old = current: rho = 1, loss = -sum(A) / #targets (token mean over the whole step)
    batch.old_logp = {0: current.value.detach()}
    loss, m = algo.loss(ctx, batch, current, 0)
    assert abs(loss.item() + (tgt * adv).sum().item() / tgt.sum().item()) < 1e-6
    # rho = 1.5 everywhere: A > 0 clipped at 1 + 0.28, A < 0 unclipped (min keeps 1.5 A)
    batch.old_logp = {0: current.value.detach() - math.log(1.5)}
    loss, m = algo.loss(ctx, batch, current, 0)
    coef = torch.where(adv > 0, torch.tensor(1.28), torch.tensor(1.5))
    assert abs(loss.item() + (tgt * coef * adv).sum().item() / tgt.sum().item()) < 1e-5
    # rho = 0.5: A < 0 clipped at 1 - 0.2
    batch.old_logp = {0: current.value.detach() - math.log(0.5)}
    loss, m = algo.loss(ctx, batch, current, 0)
    coef = torch.where(adv > 0, torch.tensor(0.5), torch.tensor(0.8))
    assert abs(loss.item() + (tgt * coef * adv).sum().item() / tgt.sum().item()) < 1e-5
    # the log-ratio is clamped at 10 before exp
    batch.old_logp = {0: current.value.detach() - 50.0}
    _, m = algo.loss(ctx, batch, current, 0)
    assert abs(m["ratio_mean"] - math.exp(10.0)) / math.exp(10.0) < 1e-4


def test_zero_variance_groups_are_filtered_and_kl_is_to_the_reference():
    model, algo, ctx = setup(DiRLConfig(), "sdar")
    batch = replay_batch(True, seed=2, gen_len=8)
    batch.rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # group 0 has no signal
    batch.advantages = algo.advantages(ctx, batch)
    assert batch.active.tolist() == [0, 0, 0, 1, 1, 1]
    a = batch.advantages.values[3:]
    assert torch.allclose(a, (batch.rewards[3:] - 1 / 3) / batch.rewards[3:].std(unbiased=False))

    class SameRef:  # the reference equals the policy: KL exactly 0
        def scoring(self):
            return stages.frozen(model)

    stages.prepare(algo, ctx, batch, model, reference=SameRef())
    ctx.norms = algo.normalizers(batch)
    assert ctx.norms["targets"] == float(((batch.state.round >= 0) & (batch.active[:, None] > 0)).sum())
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert m["kl"] == 0.0 and abs(m["ratio_mean"] - 1.0) < 1e-6


@pytest.mark.parametrize("family", ["sdar", pytest.param("sdar_moe", marks=pytest.mark.integration),
                                    pytest.param("llada2_moe", marks=pytest.mark.integration)])
def test_trains_end_to_end(tmp_path, family):
    hist = run_recipe(tmp_path, "dirl", family, "algorithm.filter_zero_variance=false")
    assert len(hist) == 2
    for h in hist:
        assert math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) and h["nfe"] > 0
        assert h["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and "kl" in h


def test_speed_reward_from_the_step_map_end_to_end(tmp_path, monkeypatch):
    """DiRL's speed term as the recipe's reward: each sample is scored from its own step map (tokens / distinct
    steps); the tiny model never solves a Sudoku, so the reward is the wrong-answer branch, 0 (slow) .. -0.5 (fast)."""
    from dare.rewards.speed import cosine, rollout_info
    seen = []
    real = stages.prepare

    def spy(algo, ctx, batch, *a, **k):
        seen.append((batch.rewards.clone(), rollout_info(batch.completion_mask, batch.step_map, 4)))
        return real(algo, ctx, batch, *a, **k)

    monkeypatch.setattr(stages, "prepare", spy)
    hist = run_recipe(tmp_path, "dirl", "sdar", "reward.name=null", "reward.terms={speed_cosine: 1.0}",
                      "algorithm.filter_zero_variance=false", "rollout.sampler.threshold=0.011")
    assert len(hist) == 2 and all(math.isfinite(h["loss"]) for h in hist)
    speeds = []
    for rewards, info in seen:
        for r, inf in zip(rewards.tolist(), info):
            speed = inf["tokens"] / inf["steps"]
            speeds.append(speed)
            assert r == pytest.approx(cosine(min(speed - 1, 3), 3, -0.5, 0.0), abs=1e-6)
    assert len(set(speeds)) > 1  # threshold decoding: samples decode at different speeds
