"""Ulysses sequence parallelism: SP = 2 (two gloo processes) gives the log-probs and gradients of SP = 1.

Every native family, on an odd length (padding), a left-padded batch, a packed row and (block-diffusion families)
the ``[x_t ; x_0]`` layout; SDAR with one key/value head exercises the repeat of heads that 2 does not divide.
DiffusionGemma (transformers' layers, Ulysses around their SDPA) on an RL view ``[prompt ; clean blocks ; canvas]``
with left padding and on packed SFT rows with self-conditioning, both with parts of odd length (padding); its full
attention layers have one key/value head.
"""
import json

import pytest
import torch

from dare.models import sequence_parallel as S
from dare.models import LogitsRequest, tiny
from tests.trainer.helpers import ROOT, run_workers

WORKER = ROOT / "tests" / "models" / "sequence_parallel_worker.py"
FAMILIES = ["llada", "dream", "sdar:1", "llada2", "lladamoe", "sdarmoe", "llada21", "diffusion_gemma"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence_parallel")
    run_workers(WORKER, str(out), *FAMILIES, timeout=300,
                hang="the sequence-parallel worker hung (a collective that one rank skipped)")
    return tuple([json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1))


@pytest.mark.integration
@pytest.mark.multiprocess
def test_every_family_and_layout_was_measured(measured):
    zero, one = measured
    # fp64 + fp32: three cases per native family, a fourth for the four block-diffusion ones, two for DiffusionGemma
    assert len(zero) == len(one) == 2 * (3 * (len(FAMILIES) - 1) + 4 + 2)
    assert {r["family"] for r in zero} == set(FAMILIES)
    assert all(r["targets"] > 0 for r in zero)
    for a, b in zip(zero, one):  # both ranks end with the whole [B, L] log-probs and the same reduced gradient
        assert a == {**b, "rank": 0}


@pytest.mark.integration
@pytest.mark.multiprocess
def test_float64_log_probs_and_gradients_equal_within_1e_6(measured):
    for r in measured[0]:
        if r["dtype"] == "float64":
            # The log-softmax runs in fp32 (linear_log_prob), so fp64 differences are fp32 rounding of the head's
            # gradient accumulated over other row sets: measured <= 3.4e-7 on the native families, 1.1e-6 on
            # DiffusionGemma, whose soft-capped head has gradients of 24-27 (4e-8 of the largest entry).
            assert r["logp_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6 * max(1.0, r["grad_scale"]), r


@pytest.mark.integration
@pytest.mark.multiprocess
def test_float32_log_probs_and_gradients_equal_to_rounding(measured):
    for r in measured[0]:
        if r["dtype"] == "float32":
            assert r["logp_diff"] <= 1e-5, r
            assert r["grad_diff"] <= 2e-6 * r["grad_scale"], r  # measured <= 8.2e-7 of the largest gradient entry


def test_models_without_a_sequence_parallel_forward_fail_at_assembly():
    S.check_model(tiny("llada"), 1)
    S.check_model(tiny("llada"), 2)  # 4 heads
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        S.check_model(tiny("llada"), 3)
    S.check_model(tiny("diffusiongemma"), 2)  # transformers' layers inside Ulysses' swaps
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        S.check_model(tiny("diffusiongemma"), 3)


def test_a_forward_refuses_what_it_cannot_shard():
    model = tiny("llada")
    sp = S.SequenceGroup(group=None, size=2, rank=0)  # the checks run before any collective
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="length divisible"):
        model(ids[:, :7], sequence_parallel=sp)
    with pytest.raises(ValueError, match="no KV cache and no row selection"):
        model(ids, sequence_parallel=sp, request=LogitsRequest(rows=slice(0, 4)))


def test_diffusion_gemma_splits_the_encoder_part_and_the_canvas_each():
    """Each part is padded to a multiple of the group (padding: document -1) and rank r holds slice r of each; a
    forward refuses parts that do not divide, before any collective."""
    from dare.algorithms.common.views import prompt_completion_view
    model = tiny("diffusiongemma")
    prompt = torch.ones(1, 5, dtype=torch.long)
    view = prompt_completion_view(prompt, torch.ones(1, 5, dtype=torch.long), torch.ones(1, 7, dtype=torch.long),
                                  torch.ones(1, 7, dtype=torch.long), torch.ones(1, 7, dtype=torch.bool), canvas_length=4)
    assert view.layout.enc_len == 9 and view.input_ids.shape[1] == 16  # encoder: prompt + one clean block; canvas 7
    for rank, want in ((0, [0, 1, 2, 3, 4, 9, 10, 11, 12]), (1, [5, 6, 7, 8, -1, 13, 14, 15, -1])):
        sp = S.SequenceGroup(group=None, size=2, rank=rank)
        sharded = model.sequence_parallel_inputs(sp, view.input_ids, layout=view.layout)
        assert sharded.rows.tolist() == want
        assert sharded.layout.enc_len == 10 and sharded.input_ids.shape[1] == 18
        assert sharded.layout.enc_doc[0, -1] == -1 and sharded.layout.dec_doc[0, -1] == -1
        local = sharded.local_rows(16)
        assert [local[r].item() for r in want if r >= 0] == [i for i, r in enumerate(want) if r >= 0]
        assert int((local >= 0).sum()) == sum(r >= 0 for r in want)
    with pytest.raises(ValueError, match="divisible by distributed.sequence_parallel=2"):
        model(view.input_ids, layout=view.layout, request=LogitsRequest.hidden_states(),
              sequence_parallel=S.SequenceGroup(group=None, size=2, rank=0))
