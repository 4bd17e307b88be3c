"""dare's losses against the authors' published loss code (docs/loss_parity.md).

Every case in tests/assets/loss_parity/ was made by scripts/make_loss_parity.py from a reference checkout: inputs, the
dare config with the reference's hyperparameters, and the reference's loss value and gradients w.r.t. the
current-policy log-probs (the case's leaves). Each case names a runner below that feeds the same inputs to dare's
own hooks (estimator and/or loss) and returns the loss and the leaves; both must equal the reference to 1e-6.
"""
from __future__ import annotations

import pytest
import torch

from dare.algorithms import Batch, LogLik, StepContext, build_algorithm, get_algorithm
from tests.algorithms import parity_io
from tests.algorithms.parity_io import TableModel, case_paths, completion_hidden, load_case, stub_adapter

TOL = dict(rtol=1e-6, atol=1e-6)
RUNNERS = {}


def runner(name):
    def register(fn):
        RUNNERS[name] = fn
        return fn
    return register


# ----------------------------------------------------------------------------------------------------------
# Shared plumbing
# ----------------------------------------------------------------------------------------------------------


def rl_batch(x: dict, **extra) -> Batch:
    """An RL batch from a case's sequence tensors (uid = row index)."""
    B = x["completion_ids"].shape[0]
    fields = {k: x[k] for k in ("group", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rewards",
                                "advantages") if k in x}
    fields.setdefault("group", torch.arange(B))
    batch = Batch(uid=torch.arange(B), **fields, **extra)
    if "advantages" in x:
        batch["active"] = torch.ones(B)
    for key in ("old_logp", "ref_logp"):
        if key in x:
            batch[key] = {0: x[key]}
    return batch


def context(algo, batch: Batch, adapter=None) -> StepContext:
    """A step context with the batch's global normalisers (one micro-batch, one rank)."""
    ctx = StepContext(step=0, seed=0, adapter=adapter or stub_adapter())
    if "advantages" not in batch:
        batch["advantages"] = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    return ctx


def leaf(x: dict, name: str) -> torch.Tensor:
    return x[name].clone().requires_grad_(True)


# ----------------------------------------------------------------------------------------------------------
# Runners: dare's side of each kind of case
# ----------------------------------------------------------------------------------------------------------


@runner("token_grpo")
def token_grpo(algo, x, monkeypatch):
    """The shared token-level clipped GRPO loss on given per-token log-probs (d1)."""
    batch = rl_batch(x)
    ctx = context(algo, batch)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}


def estimator_and_loss(algo, x, batch, ctx, hidden: list[torch.Tensor], leaves: dict):
    """dare's views (``corrupt``, masks substituted by the test), its estimator on the reference's logits, its loss."""
    views = algo.corrupt(ctx, batch, 0)
    assert len(views) == len(hidden), f"dare builds {len(views)} views, the reference scored {len(hidden)}"
    current = algo.log_likelihood(ctx, TableModel(hidden), batch, views)
    return algo.loss(ctx, batch, current, 0)[0], leaves


@runner("coupled_grpo")
def coupled_grpo(algo, x, monkeypatch):
    """Coupled-GRPO's views (the reference's t and v1 mask), view combination and loss."""
    from dare.algorithms import coupled_grpo as module
    monkeypatch.setattr(module, "coupled_masks", lambda *a, **k: (x["v1"], x["t"]))
    batch = rl_batch(x)
    ctx = context(algo, batch)
    views = leaf(x, "logp_views")
    P = x["prompt_ids"].shape[1]
    hidden = [completion_hidden(views[v], P, x["completion_ids"]) for v in range(3)]
    return estimator_and_loss(algo, x, batch, ctx, hidden, {"logp_views": views})


@runner("spg")
def spg(algo, x, monkeypatch):
    """SPG's draws (the reference's prompt / completion masks), bounds and loss."""
    from dare.algorithms import spg as module
    J = x["completion_masked"].shape[0]
    none = torch.full((x["completion_ids"].shape[0],), -1)
    monkeypatch.setattr(module, "spg_masks", lambda *a, **k: [(x["prompt_masked"][j], x["completion_masked"][j], none)
                                                             for j in range(J)])
    batch = rl_batch(x)
    ctx = context(algo, batch)
    draws = leaf(x, "logp_draws")
    P = x["prompt_ids"].shape[1]
    hidden = [completion_hidden(draws[j], P, x["completion_ids"]) for j in range(J)]
    return estimator_and_loss(algo, x, batch, ctx, hidden, {"logp_draws": draws})


@runner("espo")
def espo(algo, x, monkeypatch):
    """ESPO's MC masks (the reference's), main + complement ELBO and sequence-level loss."""
    from dare.algorithms import espo as module
    monkeypatch.setattr(module, "stratified_masks", lambda *a, **k: (x["main_masked"], x["counts"]))
    batch = rl_batch(x)
    ctx = context(algo, batch)
    passes = leaf(x, "logp_passes")
    P = x["prompt_ids"].shape[1]
    hidden = [completion_hidden(passes[j, h], P, x["completion_ids"]) for j in range(passes.shape[0]) for h in (0, 1)]
    return estimator_and_loss(algo, x, batch, ctx, hidden, {"logp_passes": passes})


@runner("replay")
def replay(algo, x, monkeypatch):
    """Trajectory replay (CJ-GRPO, TraceRL, DiRL): dare's replay plan of the step map, its token weights and loss."""
    block = int(x["block_size"]) if "block_size" in x else None
    batch = rl_batch(x, step_map=x["step_map"])
    ctx = StepContext(step=0, seed=0, adapter=stub_adapter(block))
    if "advantages" not in batch:
        batch["advantages"] = algo.advantages(ctx, batch)
    algo.corrupt(ctx, batch, 0)
    ctx.norms = algo.normalizers(batch)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}


@runner("mdpo")
def mdpo(algo, x, monkeypatch):
    """MDPO's step rewards -> step advantages, top-step selection, per-step views (targets, 1/t, confidence), loss."""
    B, S = x["step_rewards"].shape
    trajectory = {"states": x["states"], "x0": x["x0"], "confidence": x["confidence"],
                  "valid": torch.ones(B, S, dtype=torch.bool)}
    batch = rl_batch(x, trajectory=trajectory, step_rewards=x["step_rewards"])
    ctx = StepContext(step=0, seed=0, adapter=stub_adapter())
    batch["advantages"] = algo.advantages(ctx, batch)
    batch["views"] = {0: algo.corrupt(ctx, batch, 0)}
    steps = batch.meta["mdpo_steps"]
    logp = leaf(x, "logp_steps")
    batch["ref_logp"] = {0: torch.cat([x["ref_logp"][s] for s in steps], dim=1)}
    ctx.norms = algo.normalizers(batch)
    current = LogLik(torch.cat([logp[s] for s in steps], dim=1))
    return algo.loss(ctx, batch, current, 0)[0], {"logp_steps": logp}


# ----------------------------------------------------------------------------------------------------------


CASES = case_paths()


def test_every_registered_method_with_published_code_has_a_case():
    methods = {load_case(p)["method"] for p in CASES}
    assert {"d1", "wd1", "coupled_grpo", "spg", "espo", "mdpo", "cj_grpo", "tracerl", "dirl"} <= methods


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_loss_and_gradient_match_the_reference(path, monkeypatch, request):
    case = load_case(path)
    if case.get("xfail"):  # a known mismatch, reported to be decided; strict: a fix makes this case fail as XPASS
        request.applymarker(pytest.mark.xfail(reason=case["xfail"], strict=True))
    algo = build_algorithm(get_algorithm(case["method"]).config_class(name=case["method"], **case["config"]))
    loss, leaves = RUNNERS[case["runner"]](algo, case["inputs"], monkeypatch)
    loss.backward()
    expected = case["expected"]
    torch.testing.assert_close(loss.detach().double(), expected["loss"], **TOL)
    assert sorted(leaves) == case["leaves"]
    for name, value in leaves.items():
        assert value.grad is not None, f"dare's loss does not depend on {name}"
        torch.testing.assert_close(value.grad.double(), expected["grad"][name], **TOL, msg=lambda m: f"{name}: {m}")
