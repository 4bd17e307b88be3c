"""``build_prompts`` tokenizes a fast tokenizer's prompts a chunk per call (dare/data/prompt_batches.py): the result is
the row-by-row build's, prompt for prompt, skipped row for skipped row and error for error."""
import dataclasses
import logging

import pytest

from dare.data import DataConfig, build_prompts, load_examples
from dare.data.prompt_batches import batches_well
from dare.data.prompts import PromptBudget
from dare.data.schema import DataError
from dare.models.tokenizer import load_tokenizer
from tests.conftest import TOKENIZERS

QUICKSTART_TOKENIZER = "src/dare/assets/quickstart/lazy-sudoku-llada-sft"


@pytest.fixture(scope="module")
def dream():
    return load_tokenizer(TOKENIZERS / "dream-v0-instruct")


@pytest.fixture
def calls(dream, monkeypatch):
    """Each tokenizer call: True for a chunk (a list of texts), False for one text."""
    seen, real = [], type(dream).__call__
    monkeypatch.setattr(type(dream), "__call__", lambda self, text, *a, **k: seen.append(isinstance(text, list))
                        or real(self, text, *a, **k))
    return seen


def _rows(built):
    return [(p.example["id"], p.text, p.input_ids) for p in built]


def _both(examples, tokenizer, cfg, budget=None, chunk=64):
    return (build_prompts(examples, tokenizer, cfg, budget, chunk=chunk),
            build_prompts(examples, tokenizer, cfg, budget, chunk=None))


def test_the_tokenizers_dare_ships_and_tests_batch(dream):
    assert batches_well(load_tokenizer(QUICKSTART_TOKENIZER)) and batches_well(dream) and not batches_well(object())


@pytest.mark.parametrize("name,template", [("gsm8k", "reasoning"), ("countdown", "reasoning"), ("sudoku", "compact")])
def test_chunks_build_the_row_by_row_prompts(dream, calls, name, template):
    cfg = DataConfig(name=name, split="train", template=template, limit=300)
    examples = load_examples(cfg)
    chunked, rows = _both(examples, dream, cfg)
    assert calls == [True] * 5 + [False] * 300  # 5 chunks of up to 64, then one call per row
    assert len(rows) == 300 and _rows(chunked) == _rows(rows)
    assert _rows(build_prompts(examples, dream, cfg)) == _rows(rows)  # the entry point takes the chunked path
    plain = dataclasses.replace(cfg, chat_template="never")  # the tokenizer's own specials instead of a chat template
    chunked, rows = _both(examples, dream, plain)
    assert _rows(chunked) == _rows(rows) and chunked[0].text != _rows(_both(examples, dream, cfg)[1])[0][1]


def test_skipped_rows_are_the_same_rows_in_the_same_order(dream, caplog):
    cfg = DataConfig(name="gsm8k", split="train", template="reasoning", limit=400, on_bad_row="skip")
    examples = load_examples(cfg)
    lengths = sorted(len(p.input_ids) for p in build_prompts(examples, dream, cfg, chunk=None))
    cap = lengths[len(lengths) // 2]  # about half the prompts are over it
    for limits in (dict(cfg=dataclasses.replace(cfg, max_prompt_tokens=cap)),
                   dict(cfg=cfg, budget=PromptBudget(cap, "a test budget"))):
        logs = []
        for chunk in (64, None):
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                built = build_prompts(examples, dream, limits["cfg"], limits.get("budget"), chunk=chunk)
            logs.append([r.getMessage() for r in caplog.records])
            logs[-1].append(_rows(built))
        assert logs[0] == logs[1]
        assert 100 < len(logs[0][-1]) < 300 and all(len(ids) <= cap for _, _, ids in logs[0][-1])


def test_the_first_bad_row_is_the_error_either_way(dream):
    examples = load_examples(DataConfig(name="gsm8k", split="train", template="reasoning", limit=200))
    lengths = [len(p.input_ids) for p in build_prompts(
        examples, dream, DataConfig(name="gsm8k", split="train", template="reasoning"), chunk=None)]
    cap = sorted(lengths)[-5]  # a handful of rows over it, the first of them somewhere past the first chunk
    first = next(i for i, n in enumerate(lengths) if n > cap)
    cfg = DataConfig(name="gsm8k", split="train", template="reasoning", max_prompt_tokens=cap)
    messages = []
    for chunk in (16, None):
        with pytest.raises(DataError) as err:
            build_prompts(examples, dream, cfg, chunk=chunk)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and f"row {examples[first].get('index')})" in messages[0]


def test_chunks_with_a_long_row_or_a_failing_row_are_built_row_by_row(dream, calls):
    """A row long enough for encode_within's bounded prefix, one over the character bound and one whose template
    raises: their chunks take the row-by-row path, which refuses or raises them in their place."""
    cfg = DataConfig(name="gsm8k", split="train", template="reasoning", limit=96, max_prompt_tokens=600,
                     on_bad_row="skip")
    examples = load_examples(cfg)
    examples[10] = {**examples[10], "question": "word " * 1200}  # > 600 x 8 characters: the prefix step refuses it
    examples[40] = {**examples[40], "question": "x" * 10**7}  # over the character bound
    examples[70] = {**examples[70], "question": "a short one"}
    chunked = build_prompts(examples, dream, cfg, chunk=32)
    assert calls.count(True) == 1  # rows 64-95; the chunks of rows 10 and 40 went row by row
    rows = build_prompts(examples, dream, cfg, chunk=None)
    assert _rows(chunked) == _rows(rows) and len(rows) == 94
    broken = [dict(e) for e in examples]
    del broken[50]["question"]  # the template's KeyError, raised in its place by both builds
    errors = []
    for chunk in (32, None):
        with pytest.raises(Exception) as err:
            build_prompts(broken, dream, cfg, chunk=chunk)
        errors.append((type(err.value), str(err.value)))
    assert errors[0] == errors[1]
