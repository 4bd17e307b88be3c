"""Merging the rollouts of several generate() calls of one step (``trainer.rl._merge``): every per-row field of the
merged rollout is the chunks' rows in order, whatever field ``Rollout`` gains; a field of a kind with no merge rule
is an error, never chunk 0's value (issue 27: a forgotten field was silently copied from the first chunk)."""
import dataclasses

import pytest
import torch

from dare.models import tiny
from dare.rollout import Record, Rollout, SamplerConfig, generate
from dare.trainer.rl import _merge

CONFIG = SamplerConfig(gen_length=8, block_length=4, steps=8, temperature=1.0, threshold=0.3)
RECORD = Record(entropy=True)


@pytest.fixture(scope="module")
def chunks():
    model = tiny("llada", seed=3)
    first = generate(model, [[11, 12, 13, 14, 15], [21, 22]], CONFIG, n=2, seeds=[1, 2], record=RECORD)
    second = generate(model, [[31, 32, 33]], CONFIG, n=2, seeds=[3], record=RECORD)
    return first, second


def test_every_per_row_field_is_the_chunks_rows_in_order(chunks):
    first, second = chunks
    merged = _merge([first, second], pad_id=0)
    rows = first.sequences.shape[0]
    assert merged.prompt_length == max(first.prompt_length, second.prompt_length)
    assert merged.nfe == first.nfe + second.nfe
    assert merged.prompt_index.tolist() == first.prompt_index.tolist() + (second.prompt_index + 2).tolist()
    assert merged.seeds == first.seeds + second.seeds
    per_row = [f.name for f in dataclasses.fields(Rollout)
               if isinstance(getattr(first, f.name), torch.Tensor) and f.name not in ("sequences", "attention_mask",
                                                                                     "prompt_index")]
    assert {"row_nfe", "num_steps", "entropy_map", "step_map", "completion_ids"} <= set(per_row)
    for name in per_row:
        got = getattr(merged, name)
        assert torch.equal(got[:rows], getattr(first, name)) and torch.equal(got[rows:], getattr(second, name)), name
    # prompts re-padded on the left to the common width, completions unchanged
    width = second.prompt_length
    assert torch.equal(merged.sequences[rows:, merged.prompt_length - width:], second.sequences)
    assert not merged.attention_mask[rows:, :merged.prompt_length - width].any()


def test_a_field_without_a_merge_rule_is_an_error(chunks):
    first, second = chunks
    odd = [dataclasses.replace(first, row_nfe=[1, 2, 3, 4]), dataclasses.replace(second, row_nfe=[5, 6])]
    with pytest.raises(TypeError, match="row_nfe"):
        _merge(odd, pad_id=0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        _merge([first, dataclasses.replace(second, stop_token_ids=(99,))], pad_id=0)
