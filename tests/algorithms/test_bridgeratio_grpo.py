"""BridgeRatio-GRPO: the coupled-path ratio estimator, its corrections and loss; loss parity runner; learning."""
import math

import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.bridgeratio_grpo import BridgeRatioGRPOConfig, bridge_log_ratio
from dare.algorithms.batch import Advantages, LogLik
from dare.models import tiny, tiny_tokenizer
from tests.algorithms.helpers import learning_families, rl_batch
from tests.algorithms.test_loss_parity import _hidden, estimator_and_loss, leaf, runner
# shared tiny `dare train` runners and the autouse one-thread fixture
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401


@runner("bridgeratio_grpo")
def loss_parity(algo, x, monkeypatch):
    """tests/algorithms/test_loss_parity.py runs it on the bridgeratio_grpo* cases: the reference's t and path-1 mask,
    dare's three paths scoring the reference's logits, the ratio estimator and the loss (advantages from rewards)."""
    from dare.algorithms import bridgeratio_grpo as module
    from tests.algorithms.test_loss_parity import case_batch
    monkeypatch.setattr(module, "coupled_masks", lambda *a, **k: (x["v1"], x["t"]))
    views = leaf(x, "logp_views")  # all masked, t, 1 - t
    return estimator_and_loss(algo, case_batch(x), {"logp_views": views}, _hidden(x, list(views)))


def _paths(seed=0, B=4, K=3):
    g = torch.Generator().manual_seed(seed)
    cur = -3 * torch.rand(B, K, generator=g, dtype=torch.float64)
    return cur, cur + 0.3 * torch.randn(B, K, generator=g, dtype=torch.float64)


def test_plain_estimate_is_the_log_ratio_of_the_path_sums():
    cur, old = _paths()
    value, corr = bridge_log_ratio(cur, old)
    torch.testing.assert_close(value, torch.log(cur.exp().sum(1) / old.exp().sum(1)))
    assert not corr.any()
    # one path: the plain difference (d1's single-path log-ratio); equal paths: ratio 1 in every mode
    torch.testing.assert_close(bridge_log_ratio(cur[:, :1], old[:, :1])[0], (cur - old)[:, 0])
    for mode in ("none", "delta", "jackknife", "cumulant"):
        torch.testing.assert_close(bridge_log_ratio(cur, cur.clone(), mode)[0], torch.zeros(4, dtype=torch.float64))


def test_corrections_follow_their_definitions():
    cur, old = _paths(1)
    K = cur.shape[1]
    plain = bridge_log_ratio(cur, old)[0]
    # delta: + (CV^2(cur) - CV^2(old)) / 2K, CV^2 of exp(paths), population variance
    cv2 = lambda p: p.exp().var(1, unbiased=False) / p.exp().mean(1) ** 2  # noqa: E731
    torch.testing.assert_close(bridge_log_ratio(cur, old, "delta")[0], plain + (cv2(cur) - cv2(old)) / (2 * K))
    # jackknife: K * full - (K - 1) * mean of the leave-one-out estimates
    loo = torch.stack([bridge_log_ratio(cur[:, [j for j in range(K) if j != i]],
                                        old[:, [j for j in range(K) if j != i]])[0] for i in range(K)], 1)
    torch.testing.assert_close(bridge_log_ratio(cur, old, "jackknife")[0], K * plain - (K - 1) * loo.mean(1))
    # cumulant: exact when every path moves by the same amount (log E_w exp(c) = c, variance 0)
    shift = torch.tensor([0.3, -0.2, 0.0, 1.1], dtype=torch.float64)
    torch.testing.assert_close(bridge_log_ratio(old + shift[:, None], old, "cumulant")[0], shift)
    torch.testing.assert_close(bridge_log_ratio(old + shift[:, None], old)[0], shift)
    # ... and a second-order expansion of the plain estimate for small differences
    small = old + 1e-3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert (bridge_log_ratio(small, old, "cumulant")[0] - bridge_log_ratio(small, old)[0]).abs().max() < 1e-7


def test_detached_delta_carries_no_gradient():
    cur, old = _paths(2)
    cur.requires_grad_(True)
    bridge_log_ratio(cur, old, "delta", detach_correction=True)[0].sum().backward()
    g_detached = cur.grad.clone()
    cur.grad = None
    bridge_log_ratio(cur, old)[0].sum().backward()
    torch.testing.assert_close(g_detached, cur.grad)  # the plain estimate's gradient: softmax of the paths
    torch.testing.assert_close(cur.grad, torch.softmax(cur.detach(), 1))


def _setup(**cfg):
    model = tiny("llada", tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo = build_algorithm(BridgeRatioGRPOConfig(**cfg))
    return model, algo, StepContext(step=1, seed=5, adapter=model.adapter)


def test_paths_are_coupled_grpo_views_with_full_weights():
    model, algo, ctx = _setup()
    batch = rl_batch(n_prompts=2, group=3, gen_len=10)
    v0, v1, v2 = algo.corrupt(ctx, batch, 0)
    P, mask = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    m0, m1, m2 = ((v.input_ids[:, P:] == mask) for v in (v0, v1, v2))
    assert m0.all() and not (m1 & m2).any() and (m1 | m2).all()
    t, scored = v1.info["t"], batch.completion_mask
    torch.testing.assert_close(v0.weight[:, P:], scored.float())
    torch.testing.assert_close(v1.weight[:, P:], (m1 & scored).float() / t[:, None])
    torch.testing.assert_close(v2.weight[:, P:], (m2 & scored).float() / (1 - t[:, None]))
    # the path scores: each view's weighted log-probs over its targets, / Lc on the token scale
    ll = algo.log_likelihood(ctx, model, batch, [v0, v1, v2])
    assert ll.value.shape == (batch.size, 3)
    seq = build_algorithm(BridgeRatioGRPOConfig(score_scale="sequence")).log_likelihood(ctx, model, batch, [v0, v1, v2])
    torch.testing.assert_close(ll.value * batch.completion_ids.shape[1], seq.value)
    # valid_tokens (DARE's _scale_bridge_path_scores): the token-scale score times the sample's own length
    own = build_algorithm(BridgeRatioGRPOConfig(score_scale="valid_tokens")).log_likelihood(ctx, model, batch,
                                                                                          [v0, v1, v2])
    torch.testing.assert_close(own.value, ll.value * scored.float().sum(1, keepdim=True))


def test_loss_is_a_dual_clipped_ppo_on_the_sequence_ratio():
    _, algo, ctx = _setup(inner_iterations=2)
    batch = rl_batch(n_prompts=1, group=4, gen_len=6)
    B = batch.size
    old = torch.zeros(B, 3)
    log_r = torch.tensor([0.5, -0.5, 0.05, 2.0])  # clipped high (A>0), clipped low (A<0), inside, dual-clipped (A<0)
    cur = old + log_r[:, None]  # every path moves by log r: the bridge ratio is exp(log r)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    batch.old_logp, batch.advantages = {0: old}, Advantages(adv, torch.ones(B))
    ctx.norms = algo.normalizers(batch)
    loss, metrics = algo.loss(ctx, batch, LogLik(cur.requires_grad_()), 0)
    r = log_r.exp()
    per_sample = torch.tensor([-1.0 * 1.2, max(float(r[1]), 0.8), -0.5 * float(r[2]), 2.0 * 3.0])
    n = batch.completion_mask.float().sum(1)
    torch.testing.assert_close(loss.detach(), (per_sample * n).sum() / n.sum())
    assert math.isclose(metrics["clip_frac"], float((n[0] + n[1]) / n.sum()), rel_tol=1e-6)  # verl: pg2 > pg1
    assert math.isclose(metrics["dual_clip_frac"], float(n[3] / n.sum()), rel_tol=1e-6)
    # zero advantage: zero loss and gradient (DARE's test)
    batch.advantages = Advantages(torch.zeros(B), torch.ones(B))
    cur = cur.detach().requires_grad_()
    algo.loss(ctx, batch, LogLik(cur), 0)[0].backward()
    assert not cur.grad.any()


def test_config_refuses_what_it_does_not_define():
    with pytest.raises(ValueError, match="no KL term"):
        BridgeRatioGRPOConfig(beta=0.01)
    with pytest.raises(ValueError, match="correction"):
        BridgeRatioGRPOConfig(correction="taylor")
    with pytest.raises(ValueError, match="full_mask_view"):
        BridgeRatioGRPOConfig(full_mask_view=False)
    with pytest.raises(ValueError, match="token mean"):
        BridgeRatioGRPOConfig(aggregation="seq_mean_token_mean")
    with pytest.raises(ValueError, match="dual_clip"):
        BridgeRatioGRPOConfig(dual_clip=None)


# `dare train` for 2 steps on every supported family: tests/algorithms/test_matrix.py.


@pytest.mark.integration
@pytest.mark.parametrize("family", learning_families("bridgeratio_grpo"))
def test_learns_a_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "bridgeratio_grpo", family)
