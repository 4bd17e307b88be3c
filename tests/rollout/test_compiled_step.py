"""``SamplerConfig.compile``: cached steps through the compiled layer stack (``dare.models.lean``). Fused kernels
round differently from the eager ops, so the compiled decode is held to the tokens: every cached reference decode
of the fixtures, and the eager decode's tokens where there is no reference. Slow: each new shape compiles."""
import dataclasses

import pytest
import torch

from dare.models import lean, load_model
from dare.rollout import SamplerConfig, generate
from tests.conftest import FIXTURES
from tests.rollout.fixture_cases import load_cases
from tests.rollout.test_fixture_parity import _check_tokens

# One pytest-xdist worker runs both files that compile (this one and the rollout benchmark's smoke run): inductor's
# start in a process (~6 s warm, ~20 s on a fresh machine) is paid once, and shapes one file made dynamic the other
# does not compile again (measured on a cold cache: 190 s apart, 159 s together).
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("inductor")]

CACHED = [c for c in load_cases("llada-tiny") if c.raw["required"] and c.config.cache in ("prefix", "dual")]


@pytest.fixture(autouse=True)
def _needs_a_working_compiler():
    problem = lean.compile_problem()
    if problem is not None:
        pytest.skip(f"torch.compile cannot build kernels on this machine: {problem}")


@pytest.fixture
def compiled_calls(monkeypatch):
    calls = []
    real = lean.run_compiled
    monkeypatch.setattr("dare.models.model.run_compiled", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_there_are_cached_reference_decodes():
    assert {c.config.cache for c in CACHED} == {"prefix", "dual"} and len(CACHED) >= 4


@pytest.mark.parametrize("case", CACHED, ids=lambda c: c.id)
def test_compiled_cached_steps_decode_the_reference_tokens(case, compiled_calls):
    model = load_model(FIXTURES / case.folder, dtype=case.dtype, mask_token_id=500)
    r = generate(model, [case.prompt], dataclasses.replace(case.config, compile=True))
    _check_tokens(case, r.completion_ids[0], r.completion_mask[0])
    assert r.nfe == case.ref_nfe + case.nfe_offset
    assert compiled_calls  # the cached steps really ran compiled


def test_compiled_batched_dream_decode_has_the_eager_tokens(compiled_calls):
    """Shifted logits, GQA, q/k/v biases, left padding (an attention mask) and rows leaving the batch."""
    model = load_model(FIXTURES / "dream-tiny", dtype=torch.float32, mask_token_id=5)
    prompts = [[11, 17, 99, 3, 41, 8], [7, 7, 120, 64], [90, 12, 33]]
    cfg = SamplerConfig(gen_length=32, block_length=8, steps=32, cache="dual", remasking="maskgit_plus", threshold=0.3)
    eager = generate(model, prompts, cfg)
    assert not compiled_calls
    compiled = generate(model, prompts, dataclasses.replace(cfg, compile=True))
    assert compiled_calls
    assert torch.equal(compiled.completion_ids, eager.completion_ids) and compiled.nfe == eager.nfe


def test_models_of_different_shapes_get_their_own_graphs(monkeypatch):
    """A graph compiled for one model must not be reused, with dimensions turned dynamic, for a model of other sizes
    (LLaDA's 4 kv heads vs Dream's 2): each decodes its eager tokens, and each shape has its own compiled stack."""
    monkeypatch.setattr(lean, "_COMPILED", {})
    cfg = SamplerConfig(gen_length=16, block_length=8, steps=16, cache="dual", threshold=0.3)
    for name in ("llada-tiny", "dream-tiny"):
        model = load_model(FIXTURES / name, dtype=torch.float32, mask_token_id=5)
        eager = generate(model, [[11, 17, 99, 3]], cfg)
        compiled = generate(model, [[11, 17, 99, 3]], dataclasses.replace(cfg, compile=True))
        assert torch.equal(compiled.completion_ids, eager.completion_ids), name
    assert len({key[0] for key in lean._COMPILED}) == 2
