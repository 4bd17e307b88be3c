"""The candidate proposal's fast path: vocabulary-wide work only at eligible positions, bit for bit the same."""
import pytest
import torch

from dare.rollout.selection import REMASKINGS, _argmax_excluding, _per_row_uniform, _prob_at, filter_logits, propose


def _gens(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def _llada_formula(logits, remask, temperature, top_k, top_p, gens, forbid):
    """The float64 Gumbel-max proposal written out of place over every position (what propose computed before
    it learned to skip positions nobody reads)."""
    filt = filter_logits(logits.float(), top_k, top_p)
    if temperature > 0:
        u = torch.stack([torch.rand(logits.shape[1:], generator=g, dtype=torch.float64) for g in gens])
        x0 = _argmax_excluding(filt.double().exp() / (-torch.log(u)) ** temperature, forbid)
    else:
        x0 = _argmax_excluding(filt, forbid)
    if remask.score == "uniform":
        return x0, torch.stack([torch.rand(x0.shape[1:], generator=g, dtype=torch.float32) for g in gens])
    return x0, _prob_at(filt, x0, torch.float64)


def test_per_row_uniform_draws_what_torch_rand_draws():
    a = _per_row_uniform(_gens(3), (5, 7), torch.float64, "cpu")
    b = torch.stack([torch.rand((5, 7), generator=g, dtype=torch.float64) for g in _gens(3)])
    assert torch.equal(a, b)


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 1.7])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
@pytest.mark.parametrize("filters", [(None, None), (5, None), (None, 0.9)])
def test_eligible_positions_get_the_same_bits_and_the_streams_stay_aligned(temperature, remasking, filters):
    R, L, V, forbid = 3, 8, 50, 7
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(R, L, V, generator=g) * 3
    logits[0, 2, forbid] = 100.0  # the forbidden token is the argmax here: the second-best pass must run
    eligible = torch.rand(R, L, generator=g) < 0.5
    eligible[1] = True
    eligible[2] = False
    eligible[2, 5] = True
    eligible[0, 2] = True
    remask = REMASKINGS[remasking]
    want_x0, want_score = _llada_formula(logits, remask, temperature, *filters, gens=_gens(R), forbid=forbid)
    for elig in (None, eligible):
        gens = _gens(R)
        cand = propose(logits, remask, temperature, *filters, gens, masked_model=True, forbid=forbid, eligible=elig)
        keep = torch.ones_like(eligible) if elig is None else eligible
        assert torch.equal(cand.x0[keep], want_x0[keep])
        assert torch.equal(cand.score[keep], want_score[keep])
        assert not (cand.x0[keep] == forbid).any()
        # every row consumed exactly what it consumed before: the next draw of each generator matches
        after = [torch.rand(1, generator=x) for x in gens]
        ref_gens = _gens(R)
        _llada_formula(logits, remask, temperature, *filters, gens=ref_gens, forbid=forbid)
        assert all(torch.equal(a, torch.rand(1, generator=x)) for a, x in zip(after, ref_gens))


def test_sampler_config_accepts_exactly_the_registered_remasking_strategies():
    """``SamplerConfig.remasking`` is checked against the registry, so a strategy added with ``register_remasking``
    is valid in configs (and an unknown name is an error naming the registered ones)."""
    from dare.rollout import SamplerConfig, register_remasking
    from dare.rollout.selection import Remasking

    with pytest.raises(ValueError, match="remasking='test_margin_left' is not one of low_confidence"):
        SamplerConfig(remasking="test_margin_left")
    register_remasking(Remasking("test_margin_left", "margin"))
    try:
        assert SamplerConfig(remasking="test_margin_left").remasking == "test_margin_left"
    finally:
        REMASKINGS.pop("test_margin_left")
