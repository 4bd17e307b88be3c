import torch

from dare.algorithms.advantages import aggregate, group_advantages, zero_variance_groups
from dare.algorithms.losses import clipped_surrogate, kl_penalty


def test_mean_advantages_sum_to_zero_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.2, 0.9])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    for mode in ("mean", "mean_std", "loo"):
        a = group_advantages(r, groups, mode)
        for gid in range(3):
            assert abs(a[groups == gid].sum().item()) < 1e-6, mode
    a = group_advantages(r, groups, "mean")
    assert torch.allclose(a[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))


def test_loo_is_scaled_mean_and_std_uses_population():
    r = torch.tensor([3.0, 1.0, 2.0, 6.0])
    groups = torch.zeros(4, dtype=torch.long)
    loo = group_advantages(r, groups, "loo")
    manual = torch.stack([r[i] - (r.sum() - r[i]) / 3 for i in range(4)])
    assert torch.allclose(loo, manual) and torch.allclose(loo, 4 / 3 * (r - r.mean()))
    z = group_advantages(r, groups, "mean_std")
    assert torch.allclose(z, (r - r.mean()) / r.std(unbiased=False))
    # constant group -> 0, not NaN
    assert torch.equal(group_advantages(torch.ones(3), torch.zeros(3, dtype=torch.long), "mean_std"), torch.zeros(3))


def test_per_step_advantages_normalise_each_column():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0]])
    a = group_advantages(r, torch.zeros(3, dtype=torch.long), "mean_std", eps=1e-4)
    assert torch.allclose(a.sum(0), torch.zeros(2), atol=1e-6)
    assert torch.allclose(a[:, 0], (r[:, 0] - r[:, 0].mean()) / (r[:, 0].std(unbiased=False) + 1e-4))


def test_zero_variance_filter():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert zero_variance_groups(r, torch.tensor([0, 0, 1, 1])).tolist() == [True, True, False, False]


def test_kl_estimators():
    l = torch.tensor([-1.0, -2.0])
    r = torch.tensor([-1.5, -2.0])
    assert torch.allclose(kl_penalty(l, r, "k1"), l - r)
    assert torch.allclose(kl_penalty(l, r, "k2"), 0.5 * (l - r) ** 2)
    assert torch.allclose(kl_penalty(l, r, "k3"), torch.exp(r - l) - (r - l) - 1)
    assert kl_penalty(l, r, "k3")[1].item() == 0.0


def test_clipped_surrogate_and_dual_clip():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.9, 0.5, 5.0]))
    loss, ratio, clipped = clipped_surrogate(logp, old, adv, 0.2)
    assert torch.allclose(loss, torch.tensor([-1.2, -0.9, 0.8, 5.0]), atol=1e-6)
    assert clipped.tolist() == [True, False, True, False]
    loss_d, _, _ = clipped_surrogate(logp, old, adv, 0.2, dual_clip=3.0)
    assert torch.allclose(loss_d, torch.tensor([-1.2, -0.9, 0.8, 3.0]), atol=1e-6)
    # ratio exactly 1 -> nothing clipped, loss = -A
    loss1, ratio1, clipped1 = clipped_surrogate(old, old, adv, 0.2, clip_high=0.28)
    assert torch.equal(ratio1, torch.ones(4)) and not clipped1.any() and torch.equal(loss1, -adv)


def test_aggregation_is_invariant_to_splitting():
    g = torch.Generator().manual_seed(0)
    per = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    norms = {"tokens": float(mask.sum()), "seqs": 6.0}
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum"):
        whole = aggregate(per, mask, mode, norms, 5)
        parts = aggregate(per[:2], mask[:2], mode, norms, 5) + aggregate(per[2:], mask[2:], mode, norms, 5)
        assert torch.allclose(whole, parts, atol=1e-6), mode
    assert torch.allclose(aggregate(per, mask, "token_mean", norms, 5), per[mask].mean())
