"""Input that could exhaust memory or be silently misread: huge rows are refused before they are tokenized, a
directory given as a data file is named as one, a tokenizer that belongs to another model is an error."""
import json
import os
import subprocess
import sys

import pytest

from dare.trainer.recipe import DataSection
from dare.data import DataConfig, load_examples
from dare.data.schema import DataError
from dare.models import tiny_tokenizer
from dare.trainer.data import load_preference_pairs, load_sft_docs
from tests.trainer.helpers import ROOT


class SpyTokenizer:
    """The tiny tokenizer, recording the length of every text it is asked to encode."""

    def __init__(self):
        self._tok = tiny_tokenizer()
        self.lengths = []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self._tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HUGE = "y" * (2 << 20)  # 2 M characters: far beyond any max_length, cheap to write


@pytest.mark.parametrize("field", ["prompt", "response"])
def test_a_huge_sft_field_is_a_bad_row_before_it_is_tokenized(tmp_path, field, caplog):
    row = {"prompt": "a", "response": "b", field: HUGE}
    pairs = write_rows(tmp_path / "huge.jsonl", [row, {"prompt": "q", "response": "r"}])
    tok = SpyTokenizer()
    with pytest.raises(DataError, match=r"huge\.jsonl, row 0 \(line 1\): .*over data\.max_length=48") as err:
        load_sft_docs(DataSection(pairs=str(pairs), max_length=48), tok)
    assert len(str(err.value)) < 1000
    assert max(tok.lengths, default=0) < 10_000, "the huge field reached the tokenizer"
    tok.lengths.clear()
    docs = load_sft_docs(DataSection(pairs=str(pairs), max_length=48, on_bad_row="skip"), tok)
    assert len(docs) == 1 and max(tok.lengths) < 10_000


def test_a_long_but_fitting_field_still_loads_and_a_merely_long_one_is_refused_with_its_count(tmp_path):
    # The bounded tokenisation must not refuse what fits: 40 characters in 48 tokens.
    fits = write_rows(tmp_path / "fits.jsonl", [{"prompt": "a", "response": "z" * 40}])
    assert len(load_sft_docs(DataSection(pairs=str(fits), max_length=48), SpyTokenizer())[0].answer) == 41
    over = write_rows(tmp_path / "over.jsonl", [{"prompt": "a", "response": "z" * 60}])
    with pytest.raises(DataError, match="prompt \\+ answer have 6[0-9] tokens, over data.max_length=48"):
        load_sft_docs(DataSection(pairs=str(over), max_length=48), SpyTokenizer())


def test_a_huge_preference_field_is_refused_before_tokenizing(tmp_path):
    pairs = write_rows(tmp_path / "pref.jsonl", [{"prompt": "p", "chosen": HUGE, "rejected": "n"}])
    tok = SpyTokenizer()
    with pytest.raises(DataError, match=r"pref\.jsonl, row 0 \(line 1\): .*over data\.max_length=48"):
        load_preference_pairs(DataSection(pairs=str(pairs), max_length=48), tok)
    assert max(tok.lengths, default=0) < 10_000


def test_a_huge_rl_prompt_is_refused_before_tokenizing(tmp_path):
    from dare.data.prompts import build_prompts
    path = write_rows(tmp_path / "rl.jsonl", [{"question": HUGE, "answer": "1"}, {"question": "1+1?", "answer": "2"}])
    cfg = DataConfig(path=str(path), format="qa", task="math", template="plain", max_prompt_tokens=64,
                     on_bad_row="skip")
    tok = SpyTokenizer()
    prompts = build_prompts(load_examples(cfg), tok, cfg)
    assert len(prompts) == 1 and max(tok.lengths) < 10_000


def test_a_line_over_the_reader_cap_is_a_bad_row_and_the_next_rows_still_load(tmp_path, monkeypatch):
    from dare.data import readers
    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1 << 20)
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"prompt": HUGE, "response": "r"}) + "\n" + json.dumps({"prompt": "q", "response": "r"}) + "\n")
    with pytest.raises(DataError, match=r"big\.jsonl, row 0 \(line 1\): the line has more than 1048576 bytes"):
        list(readers.read_records(path))
    records = list(readers.read_records(path, on_bad=lambda e: None))
    assert [(r.row, r.line, r.data) for r in records] == [(1, 2, {"prompt": "q", "response": "r"})]


def test_a_directory_given_as_a_data_file_is_named_as_a_directory(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"data file {tmp_path} is a directory, not a file"):
        load_sft_docs(DataSection(pairs=str(tmp_path)), tiny_tokenizer())
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_examples(DataConfig(path=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_examples(DataConfig(path=str(tmp_path / "missing.jsonl")))


@pytest.mark.integration
def test_dare_train_on_a_60_mb_row_stops_in_one_line_with_bounded_memory(tmp_path):
    """The issue's reproduction: before, the row was tokenized in full (about 420 bytes per character) and the
    kernel killed the run; now it is a bad row at the reader (over the line cap) or before tokenisation."""
    huge = tmp_path / "huge.jsonl"
    with open(huge, "w") as f:
        f.write('{"prompt": "' + "x" * (60 << 20) + '", "response": "r"}\n')
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}"}
    # A fresh parent reports the run's peak RSS (this test process's own children would blur the number).
    measure = ("import resource, subprocess, sys\nr = subprocess.run(sys.argv[1:])\n"
               "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(r.returncode)\n")
    proc = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "dare.cli", "train", "recipes/sft_tiny.yaml",
                           f"data.pairs={huge}", f"train.output_dir={out}", "logging.progress=false",
                           "logging.tensorboard=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    peak_kib = int(proc.stderr.rsplit("peak_kib", 1)[1].split()[0])
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("peak_kib")]
    assert "huge.jsonl, row 0 (line 1)" in proc.stderr and "over data.max_length" in proc.stderr, proc.stderr[-2000:]
    assert len(lines[-1]) < 1000
    # Reading the 60 MB line costs a few copies of it; tokenizing it would have cost ~24 GB.
    assert peak_kib < 2 << 20, f"peak RSS {peak_kib} KiB"


def test_a_smaller_tokenizer_with_other_special_ids_is_named_with_the_model(tmp_path, caplog):
    import logging

    from dare.trainer.recipe import ModelSection
    from dare.models.model_spec import load_model_spec
    from dare.trainer.model_setup import load_policy
    from tests.conftest import FIXTURES

    model_dir = FIXTURES / "llada-tiny"  # 512 ids, EOS 501, mask 500; the tiny tokenizer: 128 tokens, EOS 1, mask 2
    with caplog.at_level(logging.WARNING):
        load_policy(ModelSection(path=str(model_dir), tokenizer="tiny"))
    assert (f"the tokenizer tiny (128 tokens) is smaller than the model {model_dir} (512 ids) and has other special "
            "ids (EOS 1 vs 501, mask 2 vs 500, pad 1 vs 501" in caplog.text)
    caplog.clear()
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    with caplog.at_level(logging.WARNING):
        load_model_spec(str(model_dir), tokenizer=str(tmp_path / "tok"), device="cpu")
    assert f"the tokenizer {tmp_path / 'tok'} (128 tokens) is smaller than the model {model_dir}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_policy(ModelSection(path="tiny:llada"))  # its own tokenizer: nothing to say
        load_model_spec("tiny:llada", device="cpu")
    assert "smaller than the model" not in caplog.text
