"""ELBO log-likelihood: exactness where the bound is exact, the block NELBO identity, stratification, greedy."""
import itertools
import math

import pytest
import torch

from dare.eval.likelihood import _score_rows, elbo_loglikelihood, greedy_matches, stratified_counts
from dare.models import tiny

CTX = [5, 17, 33, 9, 41]


def _model(family):
    return tiny(family, std=0.5, seed=1).eval()


@torch.no_grad()
def _direct_logp(model, ids, pos):
    """log p(ids[pos]) with position ``pos`` masked (plain inference forward, family's own attention)."""
    x = torch.tensor([ids])
    x[0, pos] = model.adapter.mask_token_id
    logits = model.adapter.prediction_logits(model(x).logits)[0, pos]
    return float(logits.float().log_softmax(-1)[ids[pos]])


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_one_token_continuation_is_exact(family):
    model = _model(family)
    est = elbo_loglikelihood(model, CTX, [77], mc_num=4)
    assert est == pytest.approx(_direct_logp(model, CTX + [77], len(CTX)), abs=1e-5)


@torch.no_grad()
def _exact_elbo(model, ctx, ans):
    """E_l E_mask[(L/l) sum log p] by enumerating every mask subset of the answer."""
    P, L = len(ctx), len(ans)
    seq = torch.tensor(ctx + ans)
    total = 0.0
    for l in range(1, L + 1):
        subsets = list(itertools.combinations(range(L), l))
        masked = torch.zeros(len(subsets), P + L, dtype=torch.bool)
        for r, s in enumerate(subsets):
            masked[r, [P + i for i in s]] = True
        rows = _score_rows(model, seq.expand(len(subsets), -1), masked).double()
        total += (L / l) * float(rows.mean()) / L
    return total


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mc_estimate_converges_to_the_exact_bound(family):
    model = _model(family)
    ans = [77, 3, 120]
    exact = _exact_elbo(model, CTX, ans)
    est = elbo_loglikelihood(model, CTX, ans, mc_num=1500, batch_size=500, generator=torch.Generator().manual_seed(0))
    assert est == pytest.approx(exact, abs=0.03 * abs(exact))
    # a lower bound on log p is below 0 and not trivially at the uniform level
    assert exact < 0 and abs(exact - 3 * -math.log(model.arch.vocab_size)) > 0.5


@torch.no_grad()
def _block_bound(model, ctx, ans, lo, hi):
    """MDM bound of answer block [lo, hi) given the clean context and clean earlier blocks (inference forward)."""
    P, B = len(ctx), hi - lo
    prefix = ctx + ans[:lo]
    total = 0.0
    for l in range(1, B + 1):
        vals = []
        for s in itertools.combinations(range(B), l):
            x = torch.tensor([prefix + ans[lo:hi]])
            for i in s:
                x[0, len(prefix) + i] = model.adapter.mask_token_id
            logp = model(x).logits[0].float().log_softmax(-1)
            vals.append(sum(float(logp[len(prefix) + i, ans[lo + i]]) for i in s))
        total += (B / l) * (sum(vals) / len(vals)) / B
    return total


def test_block_model_estimator_is_the_sum_of_per_block_bounds():
    model = _model("sdar")  # block 4; context of 5 tokens -> answer spans the rest of block 1 and block 2
    ans = [77, 3, 120, 9, 200]
    bs = model.adapter.block_size
    P = len(CTX)
    cuts = [0] + [b * bs - P for b in range(P // bs + 1, (P + len(ans)) // bs + 1)] + [len(ans)]
    cuts = sorted(set(c for c in cuts if 0 <= c <= len(ans)))
    per_block = sum(_block_bound(model, CTX, ans, lo, hi) for lo, hi in zip(cuts, cuts[1:]))
    assert _exact_elbo(model, CTX, ans) == pytest.approx(per_block, abs=1e-4)


def test_stratified_counts_cover_every_level():
    g = torch.Generator().manual_seed(3)
    for L, n in [(5, 5), (5, 20), (7, 14), (1, 3)]:
        counts = stratified_counts(L, n, g)
        assert counts.min() >= 1 and counts.max() <= L
        assert torch.bincount(counts, minlength=L + 1)[1:].tolist() == [n // L] * L
    with pytest.raises(ValueError):
        stratified_counts(0, 4, g)


def test_estimates_are_reproducible_from_the_generator():
    model = _model("llada")
    a = elbo_loglikelihood(model, CTX, [7, 8, 9], mc_num=8, generator=torch.Generator().manual_seed(5))
    b = elbo_loglikelihood(model, CTX, [7, 8, 9], mc_num=8, batch_size=3, generator=torch.Generator().manual_seed(5))
    assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("family", ["llada", "sdar"])
@torch.no_grad()
def test_greedy_matches_its_own_greedy_decode(family):
    model = _model(family)
    # Decode greedily by hand (one most-confident token per step), then ask whether that decode is greedy.
    L, P = 3, len(CTX)
    x = torch.tensor([CTX + [model.adapter.mask_token_id] * L])
    for _ in range(L):
        logits = model(x).logits[0, P:]
        conf, pred = logits.softmax(-1).max(-1)
        open_ = x[0, P:] == model.adapter.mask_token_id
        if model.adapter.is_block_causal:
            pos = torch.arange(P, P + L)
            open_ &= (pos // model.adapter.block_size) == (pos[open_] // model.adapter.block_size).min()
        i = int(torch.where(open_, conf, torch.tensor(-1.0)).argmax())
        x[0, P + i] = pred[i]
    decoded = x[0, P:].tolist()
    assert greedy_matches(model, CTX, decoded)
    wrong = list(decoded)
    wrong[0] = (wrong[0] + 1) % 400
    assert not greedy_matches(model, CTX, wrong)
