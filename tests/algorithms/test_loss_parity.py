"""dare's losses against the authors' published loss code (docs/loss_parity.md).

Every case in tests/assets/loss_parity/ was made by scripts/make_loss_parity.py from a reference checkout: inputs, the
dare config with the reference's hyperparameters, and the reference's loss value and gradients w.r.t. the
current-policy log-probs (the case's leaves). Each case names a runner below that feeds the same inputs to dare's
own hooks (estimator and/or loss) and returns the loss and the leaves; both must equal the reference to 1e-6.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dare.algorithms import Advantages, LogLik, RLBatch, StepContext, build_algorithm, get_algorithm
from dare.algorithms.tracerl import OldValues
from tests.algorithms.helpers import corrupt
from tests.algorithms.parity_io import (
    CASE_DIR, TableModel, case_paths, completion_hidden, embed_logp, load_case, stub_adapter,
)

TOL = dict(rtol=1e-6, atol=1e-6)
RUNNERS = {}


def runner(name):
    """Register dare's side of a kind of case. A method's own runner lives next to its test
    (``tests/algorithms/test_<method>.py``, ``from tests.algorithms.test_loss_parity import runner``): a case whose
    runner is not among the shared ones below is looked up there, so a new method edits no list here."""
    def register(fn):
        if RUNNERS.setdefault(name, fn) is not fn:
            raise ValueError(f"loss-parity runner {name!r} is registered twice")
        return fn
    return register


def find_runner(case: dict):
    """The runner a case names: a shared one, else the one its method's test module registers."""
    if case["runner"] not in RUNNERS:
        import importlib
        module = f"tests.algorithms.test_{case['method']}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # the test module exists and fails to import: say that, not "missing"
                raise
            raise LookupError(f"no loss-parity runner {case['runner']!r}: not shared here and no "
                              f"tests/algorithms/test_{case['method']}.py") from e
    if case["runner"] not in RUNNERS:
        raise LookupError(f"no loss-parity runner {case['runner']!r} here or in tests/algorithms/test_{case['method']}.py")
    return RUNNERS[case["runner"]]


# ----------------------------------------------------------------------------------------------------------
# Shared plumbing
# ----------------------------------------------------------------------------------------------------------


def case_batch(x: dict, **extra) -> RLBatch:
    """An RL batch from a case's sequence tensors (uid = row index); a case's given advantages are the step's."""
    B = x["completion_ids"].shape[0]
    fields = {k: x[k] for k in ("group", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rewards")
              if k in x}
    fields.setdefault("group", torch.arange(B))
    fields.setdefault("rewards", torch.zeros(B))
    batch = RLBatch(uid=torch.arange(B), **fields, **extra)
    if "advantages" in x:
        batch.advantages = Advantages(x["advantages"], torch.ones(B))
    for key in ("old_logp", "ref_logp"):
        if key in x:
            setattr(batch, key, {0: x[key]})
    return batch


def prepared(algo, batch: RLBatch, block_size=None):
    """(step context with the batch's global normalisers, dare's views): the loop's order for one micro-batch on one
    rank -- advantages (when the case gives rewards), ``corrupt``, normalisers."""
    ctx = StepContext(step=0, seed=0, adapter=stub_adapter(block_size))
    views = corrupt(algo, ctx, batch, 0)
    if batch.advantages is None:
        batch.advantages = algo.advantages(ctx, batch)
    batch.views = {0: views}
    ctx.norms = algo.normalizers(batch)
    return ctx, views


def leaf(x: dict, name: str) -> torch.Tensor:
    return x[name].clone().requires_grad_(True)


# ----------------------------------------------------------------------------------------------------------
# Runners: dare's side of each kind of case
# ----------------------------------------------------------------------------------------------------------


@runner("token_grpo")
def token_grpo(algo, x, monkeypatch):
    """A loss on given per-token log-probs (d1's clipped GRPO; wd1's advantage weights and loss)."""
    batch = case_batch(x)
    ctx, _ = prepared(algo, batch)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}


def estimator_and_loss(algo, batch: RLBatch, leaves: dict, hidden: list[torch.Tensor]):
    """dare's views (``corrupt``, with the reference's masks substituted), its estimator scoring the reference's
    logits of each view (``TableModel``), and its loss."""
    ctx, views = prepared(algo, batch)
    assert len(views) == len(hidden), f"dare builds {len(views)} views, the reference scored {len(hidden)}"
    current = algo.log_likelihood(ctx, TableModel(hidden), batch, views)
    return algo.loss(ctx, batch, current, 0)[0], leaves


def _hidden(x: dict, per_view: list[torch.Tensor]) -> list[torch.Tensor]:
    return [completion_hidden(v, x["prompt_ids"].shape[1], x["completion_ids"]) for v in per_view]


@runner("replay")
def replay(algo, x, monkeypatch):
    """Trajectory replay (CJ-GRPO, TraceRL, DiRL): dare's replay plan of the step map, its token weights and loss."""
    batch = case_batch(x, step_map=x["step_map"])
    ctx, _ = prepared(algo, batch, int(x["block_size"]) if "block_size" in x else None)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}


def _value_prepared(algo, x: dict):
    """TraceRL with its value model, in the loop's order: ``corrupt``, the value model's old values (given: what
    ``score_frozen`` computes), the token returns and advantages, the normalisers."""
    batch = case_batch(x, step_map=x["step_map"])
    ctx = StepContext(step=0, seed=0, adapter=stub_adapter(int(x["block_size"])))
    batch.views = {0: corrupt(algo, ctx, batch, 0)}
    batch.frozen = OldValues(x["old_values"])  # what score_frozen gives
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    return ctx, batch


@runner("value_loss")
def value_loss(algo, x, monkeypatch):
    """TraceRL's value model: returns from the step-level GAE, the clipped value loss on given values."""
    ctx, batch = _value_prepared(algo, x)
    values = leaf(x, "values")
    return algo.value_loss(ctx, batch, values)[0], {"values": values}


@runner("value_policy")
def value_policy(algo, x, monkeypatch):
    """TraceRL's policy loss with the value model's token-wise advantages."""
    ctx, batch = _value_prepared(algo, x)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}


class RowTable:
    """A model whose logits for an input row are the table of the sampler state it equals (``rows [B, S, L]``,
    ``tables [B, S, L, V]``), read at ``request.rows`` (d-OPSD's teacher and student passes)."""

    def __init__(self, rows: torch.Tensor, tables: torch.Tensor):
        self.rows, self.tables = rows, tables

    def __call__(self, input_ids, attention_mask=None, position_ids=None, request=None):
        picked = []
        for row in input_ids:
            hit = (self.rows == row).all(-1).nonzero()
            assert hit.shape[0] == 1, "an input row matches no (or several) recorded states"
            picked.append(self.tables[hit[0, 0], hit[0, 1]])
        logits = torch.stack(picked)
        if request is not None and request.rows is not None:
            logits = logits.gather(1, request.rows[..., None].expand(-1, -1, logits.shape[-1]))
        return SimpleNamespace(logits=logits)


# ----------------------------------------------------------------------------------------------------------


CASES = case_paths()


def test_every_registered_method_with_published_code_has_a_case():
    """The methods whose authors published their training code (``paper.published_code``) each have a case."""
    from dare.algorithms import ALGORITHMS, load_builtin_algorithms
    load_builtin_algorithms()
    published = {n for n, c in ALGORITHMS.items() if getattr(c, "paper", None) is not None and c.paper.published_code
                 and c.__module__.startswith("dare.algorithms")}  # not a test double that inherits a method's paper
    assert len(published) >= 11  # every RL method but BGPO and EBPO (no published code) when this was written
    methods = {load_case(p)["method"] for p in CASES}
    assert published <= methods, f"no loss-parity case for {sorted(published - methods)} (docs/loss_parity.md)"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_loss_and_gradient_match_the_reference(path, monkeypatch, request):
    case = load_case(path)
    if case.get("xfail"):  # a known mismatch, reported to be decided; strict: a fix makes this case fail as XPASS
        request.applymarker(pytest.mark.xfail(reason=case["xfail"], strict=True))
    algo = build_algorithm(get_algorithm(case["method"]).config_class(name=case["method"], **case["config"]))
    loss, leaves = find_runner(case)(algo, case["inputs"], monkeypatch)
    loss.backward()
    expected = case["expected"]
    torch.testing.assert_close(loss.detach().double(), expected["loss"], **TOL)
    assert sorted(leaves) == case["leaves"]
    for name, value in leaves.items():
        assert value.grad is not None, f"dare's loss does not depend on {name}"
        torch.testing.assert_close(value.grad.double(), expected["grad"][name], **TOL, msg=lambda m: f"{name}: {m}")


def test_the_pure_token_loss_alone_matches_d1s_reference():
    """The loss math without any hook: ``losses.token_policy_loss`` on the d1 case's tensors (the step's token count
    as the normaliser, d1's clip and KL) is the authors' loss and gradient, so a method's ``loss`` only adapts."""
    from dare.algorithms.losses import token_policy_loss
    case = load_case(CASE_DIR / "d1.pt")
    x, cfg = case["inputs"], case["config"]
    mask = x["completion_mask"].float()
    logp = leaf(x, "logp")
    loss, _ = token_policy_loss(logp, x["old_logp"], x["advantages"], mask,
                                norms={"tokens": float(mask.sum()), "seqs": float(mask.shape[0])},
                                clip_low=cfg["clip_low"], clip_high=cfg["clip_high"], ref_logp=x["ref_logp"],
                                beta=cfg["beta"], kl_estimator=cfg["kl_estimator"], aggregation=cfg["aggregation"])
    loss.backward()
    torch.testing.assert_close(loss.detach().double(), case["expected"]["loss"], **TOL)
    torch.testing.assert_close(logp.grad.double(), case["expected"]["grad"]["logp"], **TOL)


# ----------------------------------------------------------------------------------------------------------
# The harness itself (runs without the reference checkouts)
# ----------------------------------------------------------------------------------------------------------


def test_embedded_logits_give_back_the_log_probs_and_their_gradient():
    logp = torch.tensor([[-0.1, -2.0, -4.0], [-1.0, -0.5, -0.02]], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[4, 5, 1], [15, 7, 2]])
    got = torch.log_softmax(embed_logp(logp, labels), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(got, logp.detach(), rtol=0, atol=1e-12)
    weight = torch.arange(6, dtype=torch.float64).view(2, 3)
    (got * weight).sum().backward()
    torch.testing.assert_close(logp.grad, weight, rtol=0, atol=1e-12)  # d log_softmax[label] / d leaf = 1
    with pytest.raises(ValueError, match="reserved"):
        embed_logp(logp.detach(), torch.zeros_like(labels))


def test_reference_loader_runs_the_file_with_inert_framework_imports(tmp_path):
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    sys.path.insert(0, scripts)
    try:
        import loss_parity_lib as lib
    finally:
        sys.path.remove(scripts)
    src = tmp_path / "reference_trainer.py"
    src.write_text(textwrap.dedent("""
        import torch
        from parity_fake_framework.trainer import BaseTrainer, profiled
        from parity_fake_framework.utils import extra_available, OutputRecord
        from .sibling_module import helper
        if extra_available():
            raise RuntimeError("availability guards must read False")

        class MyTrainer(BaseTrainer):
            @profiled
            def compute_loss(self, x):
                self.metrics["train"]["loss"].append(x.sum().item())  # never set: an inert stub
                return OutputRecord(loss=(x * self.scale).sum()).loss

        def main():
            scale = 3.0

            @torch.no_grad()
            def inner(y):
                return y * scale
            return inner
    """))
    module = lib.load_reference(src, "unit_test_reference")
    trainer = lib.trainer(module.MyTrainer, scale=2.0)
    assert trainer.compute_loss(torch.ones(3)).item() == 6.0
    assert lib.nested_function(src, "inner", torch=torch, scale=5.0)(torch.tensor(2.0)).item() == 10.0
    with pytest.raises(ValueError, match="expected one function"):
        lib.nested_function(src, "missing")


def test_a_case_finds_its_runner_in_its_method_test_or_says_where_it_looked():
    """Shared runners are here; a method's own runner is registered by its test module (imported on demand)."""
    assert find_runner({"runner": "coupled_grpo", "method": "coupled_grpo"}) is RUNNERS["coupled_grpo"]
    assert find_runner({"runner": "bridgeratio_grpo", "method": "bridgeratio_grpo"}).__module__.endswith(
        "test_bridgeratio_grpo")
    with pytest.raises(LookupError, match="no tests/algorithms/test_no_such_method.py"):
        find_runner({"runner": "nope", "method": "no_such_method"})
    with pytest.raises(LookupError, match="here or in tests/algorithms/test_d1.py"):
        find_runner({"runner": "nope", "method": "d1"})
