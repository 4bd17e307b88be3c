"""The RL-step benchmark's naive baseline computes the same numbers as ours (it only computes them the slow way),
and the benchmark runs end to end."""
import pytest
import torch

from dare.diffusion import score_targets
from dare.models import LogitsRequest, tiny
from tests.scripts import load_script


def _bench():
    return load_script("benchmarks/bench_rl_step.py")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_naive_scoring_matches_chunked_scoring(family):
    bench = _bench()
    model = tiny(family, seed=0, std=0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (2, 12), generator=g)
    targets = torch.zeros(2, 12, dtype=torch.bool)
    targets[:, 5:] = True
    targets[1, 9] = False
    labels = torch.randint(3, 200, (2, 12), generator=g)
    ours, ours_ent = score_targets(model, ids, targets, labels, with_entropy=True, temperature=0.7, chunk_size=3)
    naive, naive_ent = bench.naive_score_targets(model, ids, targets, labels, with_entropy=True, temperature=0.7)
    assert torch.allclose(ours, naive, atol=1e-5) and torch.allclose(ours_ent, naive_ent, atol=1e-5)
    assert (ours[~targets] == 0).all() and (naive[targets] != 0).all()


def test_naive_pipeline_logits_equal_and_restores():
    bench = _bench()
    from dare.algorithms import load_builtin_algorithms
    from dare.algorithms.common import scoring
    from dare.models.model import DiffusionLM
    load_builtin_algorithms()
    model = tiny("llada", seed=0)
    real_forward = DiffusionLM.forward
    ids = torch.randint(3, 200, (2, 10))
    keep = torch.tensor([[True, False, False, True], [False, False, True, False]])
    with torch.no_grad():
        pruned = model(ids, request=LogitsRequest(rows=slice(4, 8))).logits
        packed = model(ids, request=LogitsRequest(rows=slice(4, 8), keep=keep)).logits
        with bench.naive_pipeline():
            full = model(ids, request=LogitsRequest(rows=slice(4, 8))).logits
            full_packed = model(ids, request=LogitsRequest(rows=slice(4, 8), keep=keep)).logits
            assert scoring.score_targets is bench.naive_score_targets  # the likelihood estimator every method shares
    assert full.shape == pruned.shape and torch.equal(full, pruned)
    assert full_packed.shape == (3, full.shape[-1]) and torch.equal(full_packed, packed)
    assert DiffusionLM.forward is real_forward and scoring.score_targets is score_targets


@pytest.mark.integration
def test_bench_rl_step_quick(capsys):
    assert _bench().main(["--quick"]) == 0
    out = capsys.readouterr().out
    for setup in ("quickstart", "mid"):
        assert f"#### {setup}:" in out
    rows = [line for line in out.splitlines() if line.startswith("| rollout |") or line.startswith("| update |")]
    assert len(rows) == 4
    # quickstart: both pipelines decode without a cache, so the rollouts (and rewards) are identical
    quick = out.split("#### quickstart")[1].split("####")[0]
    rewards = quick.split("Training reward per step: naive ")[1].split(";")[0]
    naive_r, ours_r = rewards.split(", ours ")
    assert naive_r == ours_r.rstrip(".")
