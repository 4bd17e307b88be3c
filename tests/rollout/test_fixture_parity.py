"""Ground truth: ``dare.rollout.generate`` reproduces every required greedy decode of every family's reference
sampler token for token (tests/assets/fixtures/*/expected_generate.json), alone and batched."""
import dataclasses
from collections import defaultdict
from functools import lru_cache

import pytest
import torch

from dare.models import load_model
from dare.rollout import Record, generate
from tests.conftest import FIXTURES
from tests.rollout.fixture_cases import FOLDERS, load_cases

CASES = [c for f in FOLDERS for c in load_cases(f) if c.raw["required"]]
BLOCK_REFERENCE_WITHOUT_CACHE = [c for c in CASES if c.config.cache == "none" and c.folder.startswith("llada2")]


@lru_cache(maxsize=None)
def _model(folder: str, dtype: torch.dtype):
    return load_model(FIXTURES / folder, dtype=dtype, mask_token_id=500)


def _check_tokens(case, completion: torch.Tensor, completion_mask: torch.Tensor):
    got = completion.tolist()[:len(case.expected)]
    assert got == case.expected
    if case.expected and case.expected[-1] in case.stop_ids:  # completion_mask ends at the first stop token
        assert int(completion_mask.sum()) == len(case.expected)


def test_every_fixture_folder_has_required_cases():
    assert {c.folder for c in CASES} == set(FOLDERS)
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_decode(case):
    r = generate(_model(case.folder, case.dtype), [case.prompt], case.config, hints=case.hints)
    _check_tokens(case, r.completion_ids[0], r.completion_mask[0])
    assert int(r.row_nfe[0]) == r.nfe  # one prompt: its own NFE is every forward (the reference's count below)
    if case.nfe_offset is not None:
        expected = case.ref_nfe + case.nfe_offset
        assert r.nfe == expected if case.nfe_relation == "eq" else r.nfe <= expected


@pytest.mark.parametrize("case", BLOCK_REFERENCE_WITHOUT_CACHE, ids=lambda c: c.id)
def test_llada2_exact_block_cache_gives_the_reference_tokens(case):
    """The HF LLaDA2 loop recomputes the prefix every step; the exact block cache must decode the same
    tokens with the same number of forwards (storing finished blocks rides along with the next step)."""
    cfg = dataclasses.replace(case.config, cache="block")
    r = generate(_model(case.folder, case.dtype), [case.prompt], cfg)
    _check_tokens(case, r.completion_ids[0], r.completion_mask[0])
    assert r.nfe == int(r.num_steps[0])
    assert r.nfe == case.ref_nfe if case.nfe_relation == "eq" else r.nfe <= case.ref_nfe


def _groups():
    groups = defaultdict(list)
    for c in CASES:
        groups[(c.folder, c.dtype, repr(c.config))].append(c)
    return [g for g in groups.values() if len({len(c.prompt) for c in g}) > 1]


@pytest.mark.parametrize("group", _groups(), ids=lambda g: f"{g[0].folder}-{g[0].index}")
def test_batched_prompts_of_different_lengths_match_the_reference(group):
    """All prompts of one parameter set decoded together (left-padded) give each case's reference tokens."""
    model = _model(group[0].folder, group[0].dtype)
    hints = None if group[0].hints is None else torch.cat([c.hints for c in group])
    r = generate(model, [c.prompt for c in group], group[0].config, hints=hints)
    assert r.prompt_index.tolist() == list(range(len(group)))
    for i, case in enumerate(group):
        _check_tokens(case, r.completion_ids[i], r.completion_mask[i])


OVERFLOW = [c for f in ("sdar-tiny", "sdarmoe-tiny") for c in load_cases(f) if c.raw["diagnostics"]["topk_overflow_steps"]]


@pytest.mark.parametrize("case", OVERFLOW, ids=lambda c: c.id)
def test_sdar_topk_overflow_is_not_reproduced(case):
    """Where the SDAR reference's top-k overflows and rewrites prompt or committed tokens, we commit only
    masks: the prompt stays intact and no written token is ever changed."""
    assert case.raw["prompt_tokens_overwritten"] or case.raw["diagnostics"]["committed_tokens_overwritten_at"]
    r = generate(_model(case.folder, case.dtype), [case.prompt], case.config, record=Record(trajectory=True))
    assert r.prompt_ids[0].tolist() == case.prompt
    t = r.trajectory
    states = torch.cat([t.states[0, :int(r.num_steps[0])], r.completion_ids[:1]])
    for before, after in zip(states[:-1], states[1:]):
        written = before != 500
        assert torch.equal(after[written], before[written])
    assert (r.step_map[0] >= 0).all()
