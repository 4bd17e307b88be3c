"""Loaders: every bundled file, both layouts of the same items, malformed rows, sources."""
import gzip
import json
import logging
import re
import sys
import types

import pytest

from dare.data import ASSETS, DATASETS, DataConfig, DataError, load_examples, validate_example
from dare.data.tasks import countdown_question


def _sources_table():
    """(file, dataset, split, rows, examples) from assets/data/SOURCES.md."""
    rows = []
    for line in (ASSETS / "SOURCES.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \| (\d+) \| (\d+) \|", line)
        if m:
            for pair in m.group(2).split(","):
                name, split = (s.strip() for s in pair.split("/"))
                rows.append((m.group(1), name, split, int(m.group(3)), int(m.group(4))))
    return rows


SOURCES = _sources_table()


GENERATED = re.findall(r"^\| `([^`]+)` \| [^|]+ \| (\d+) \| `python (scripts/[^ `]+)",
                       (ASSETS / "SOURCES.md").read_text(), flags=re.M)


def test_sources_md_lists_every_bundled_file():
    listed = {f for f, *_ in SOURCES} | {f for f, *_ in GENERATED}
    on_disk = {str(p.relative_to(ASSETS)) for p in ASSETS.rglob("*") if p.is_file() and p.name != "SOURCES.md"}
    assert GENERATED and listed == on_disk
    registered = {(n, s) for n, spec in DATASETS.items() for s in spec.files}
    assert {(n, s) for _, n, s, *_ in SOURCES} == registered


@pytest.mark.parametrize("file,name,split,rows,n_examples", SOURCES, ids=[f"{n}-{s}" for _, n, s, *_ in SOURCES])
def test_bundled_file_loads_with_documented_counts(file, name, split, rows, n_examples):
    from dare.data.readers import read_records

    assert DATASETS[name].files[split] == file
    assert sum(1 for _ in read_records(ASSETS / file)) == rows
    examples = load_examples(DataConfig(name=name, split=split))
    assert len(examples) == n_examples
    assert len({e["id"] for e in examples}) == n_examples
    for e in examples[:50] + examples[-50:]:
        validate_example(e, file)
        assert e["task"] == DATASETS[name].task
        assert e["id"].startswith(f"{name}/{split}/")


def _pairs(name, a, b):
    return list(zip(load_examples(DataConfig(name=name, split=a)), load_examples(DataConfig(name=name, split=b))))


@pytest.mark.parametrize("name,other", [("countdown", "test_d1"), ("sudoku", "test_d1"), ("humaneval", "test_dare")])
def test_original_and_dare_layouts_give_identical_examples(name, other):
    pairs = _pairs(name, "test", other)
    assert len(pairs) in (164, 256, 500)
    for x, y in pairs:
        assert x["question"] == y["question"]
        assert x["ground_truth"] == y["ground_truth"]


def test_field_values_per_task():
    cd = load_examples(DataConfig(name="countdown", split="test_d1", limit=1))[0]
    assert cd["ground_truth"] == {"numbers": [30, 100, 93], "target": 23}
    assert cd["question"] == countdown_question([30, 100, 93], 23)
    sd = load_examples(DataConfig(name="sudoku", split="test_d1", limit=1))[0]
    assert sd["ground_truth"] == {"puzzle": "3102200002100320", "solution": "3142243142131324"}  # leading zeros kept
    he = load_examples(DataConfig(name="humaneval", split="test", limit=1))[0]
    gt = he["ground_truth"]
    assert gt["entry_point"] == "has_close_elements" and gt["prefix"] == he["question"]
    assert gt["tests"].rstrip().endswith("check(has_close_elements)")
    # The tests really run against the canonical solution and fail against a wrong one.
    ns = {}
    exec(gt["prefix"] + he["canonical_solution"] + "\n" + gt["tests"], ns)
    with pytest.raises(AssertionError):
        exec(gt["prefix"] + "    return not any(True for _ in [])\n" + gt["tests"], {})
    mb = load_examples(DataConfig(name="mbpp", split="test", limit=2))[1]
    assert mb["ground_truth"]["entry_point"] == "sort_matrix" and mb["ground_truth"]["prefix"] == ""
    assert mb["ground_truth"]["tests"].count("assert sort_matrix(") == 3
    assert mb["question"].startswith("Write a function to sort a given matrix")
    gsm = load_examples(DataConfig(name="gsm8k", split="test", limit=1))[0]
    assert gsm["ground_truth"] == "18" and gsm["question"].startswith("Janet")
    aime = load_examples(DataConfig(name="aime24", split="test", limit=1))[0]
    assert aime["ground_truth"] == "204"


def test_shuffle_and_limit_are_seeded():
    a = load_examples(DataConfig(name="sudoku", split="test", shuffle_seed=3, limit=5))
    b = load_examples(DataConfig(name="sudoku", split="test", shuffle_seed=3, limit=5))
    c = load_examples(DataConfig(name="sudoku", split="test", shuffle_seed=4, limit=5))
    assert [e["id"] for e in a] == [e["id"] for e in b] != [e["id"] for e in c]
    assert [e["index"] for e in load_examples(DataConfig(name="sudoku", split="test", limit=3))] == [0, 1, 2]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_original_layout_files(tmp_path):
    gsm = _write(tmp_path / "gsm.jsonl", [json.dumps({"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"}),
                                           json.dumps({"question": "Big?", "answer": "so\n#### 1,000"})])
    ex = load_examples(DataConfig(path=str(gsm)))
    assert [e["ground_truth"] for e in ex] == ["2", "1,000"] and ex[0]["task"] == "math" and ex[0]["id"] == "gsm/0"
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "X/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n",
                            "test": "def check(candidate):\n    assert candidate(1) == 1\n", "entry_point": "f"}) + "\n")
    assert load_examples(DataConfig(path=str(he)))[0]["ground_truth"]["entry_point"] == "f"
    mbpp = _write(tmp_path / "mbpp.jsonl", [json.dumps({"task_id": 1, "text": "Add.", "code": "def add(a,b): return a+b",
                                                        "test_list": ["assert add(1, 2) == 3"]})])
    m = load_examples(DataConfig(path=str(mbpp)))[0]
    assert m["ground_truth"]["entry_point"] == "add" and m["canonical_solution"].startswith("def add")
    qa = _write(tmp_path / "aime.jsonl", [json.dumps({"problem": "p", "answer": 70}),
                                          json.dumps({"problem": "q", "solution": "so \\boxed{\\frac{1}{2}}"})])
    assert [e["ground_truth"] for e in load_examples(DataConfig(path=str(qa)))] == ["70", "\\frac{1}{2}"]
    hfcd = _write(tmp_path / "cd.jsonl", [json.dumps({"nums": [1, 2, 3], "target": 6})])
    assert load_examples(DataConfig(path=str(hfcd)))[0]["ground_truth"] == {"numbers": [1, 2, 3], "target": 6}


def test_dare_layout_with_literal_string_cells(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "countdown", "prompt": "[{'role': 'user', 'content': 'x'}]",
             "reward_model": "{'ground_truth': '7', 'style': 'rule'}", "extra_info": "{'numbers': '[1, 2, 4]', 'index': 0}"}]
    path = tmp_path / "cd.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ex = load_examples(DataConfig(path=str(path)))[0]
    assert ex["task"] == "countdown" and ex["ground_truth"] == {"numbers": [1, 2, 4], "target": 7}
    assert ex["messages"] == [{"role": "user", "content": "x"}]


BAD_ROWS = [
    ("missing.jsonl", [json.dumps({"question": "q", "answer": "#### 1"}), json.dumps({"question": "q2"})],
     r"missing\.jsonl, row 1 \(line 2\): missing field 'answer'"),
    ("empty.jsonl", [json.dumps({"problem": "q", "answer": "1"}), json.dumps({"problem": "q", "answer": "  "})],
     r"empty\.jsonl, row 1 \(line 2\): empty answer"),
    ("type.jsonl", [json.dumps({"input": "1,2,3", "output": "6"}), json.dumps({"input": "1,x", "output": "3"})],
     r"type\.jsonl, row 1 \(line 2\): field 'input' must be an integer"),
    ("json.jsonl", [json.dumps({"question": "q", "answer": "#### 1"}), "{not json"],
     r"json\.jsonl, row 1 \(line 2\): invalid JSON"),
    ("nohash.jsonl", [json.dumps({"question": "q", "answer": "#### 1"}), json.dumps({"question": "q", "answer": "#### "})],
     r"nohash\.jsonl, row 1 \(line 2\): empty answer"),
    ("sudoku.csv", ["Puzzle,Solution", "3102200002100320,3142243142131324", "3102200002100320,1142243142131324"],
     r"sudoku\.csv, row 1 \(line 3\): sudoku solution contradicts a given cell"),
    ("short.csv", ["Puzzle,Solution", "3102200002100320,3142243142131324", "31022000021,3142243142131324"],
     r"short\.csv, row 1 \(line 3\): sudoku puzzle must have 16"),
    ("ragged.csv", ["Puzzle,Solution", "3102200002100320,3142243142131324", "3102200002100320"],
     r"ragged\.csv, row 1 \(line 3\): row has 1 cells, the header has 2"),
]


@pytest.mark.parametrize("fname,lines,pattern", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_malformed_row_errors_name_file_and_row(tmp_path, fname, lines, pattern):
    path = _write(tmp_path / fname, lines)
    with pytest.raises(DataError, match=pattern):
        load_examples(DataConfig(path=str(path)))


def test_skip_policy_logs_and_drops_bad_rows(tmp_path, caplog):
    path = _write(tmp_path / "mixed.jsonl", [json.dumps({"question": "a", "answer": "#### 1"}), json.dumps({"question": "b"}),
                                             json.dumps({"question": "c", "answer": "#### 3"})])
    with caplog.at_level(logging.WARNING, logger="dare.data"):
        ex = load_examples(DataConfig(path=str(path), on_bad_row="skip"))
    assert [e["ground_truth"] for e in ex] == ["1", "3"]
    assert "mixed.jsonl, row 1 (line 2): missing field 'answer'" in caplog.text
    assert "skipped 1 bad row" in caplog.text


def test_known_bad_rows_of_bundled_math_train_are_dropped_not_fatal(caplog):
    with caplog.at_level(logging.INFO, logger="dare.data"):
        ex = load_examples(DataConfig(name="math", split="train"))
    assert len(ex) == 7470 and "row 886" in caplog.text
    with pytest.raises(DataError, match=r"math_1\.parquet, row 886: field 'reward_model.ground_truth' must be a string"):
        load_examples(DataConfig(path=str(ASSETS / "dare/rl/train/math_1.parquet")))


def test_config_and_source_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one of name, path, hf, loader or mix"):
        DataConfig(name="gsm8k", path="x.jsonl")
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_examples(DataConfig(name="gsm9k"))
    with pytest.raises(ValueError, match="no bundled split 'train'"):
        load_examples(DataConfig(name="mbpp", split="train", source="bundled"))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_examples(DataConfig(path=str(tmp_path / "nope.jsonl")))
    odd = _write(tmp_path / "odd.jsonl", [json.dumps({"foo": 1})])
    with pytest.raises(DataError, match=r"odd\.jsonl, row 0 \(line 1\): cannot tell the data layout"):
        load_examples(DataConfig(path=str(odd)))


def test_hugging_face_ids_go_through_datasets(monkeypatch):
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return [{"question": "q", "answer": "w\n#### 5"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ex = load_examples(DataConfig(name="gsm8k", split="train", source="hf"))
    assert calls == [("openai/gsm8k", "main", "train")] and ex[0]["ground_truth"] == "5"
    ex = load_examples(DataConfig(hf="someone/gsm-like", hf_config="main", split="test"))
    assert calls[-1] == ("someone/gsm-like", "main", "test") and ex[0]["id"] == "someone/gsm-like/test/0"
    calls.clear()
    olymp = {"id": 1606, "question": "Find x.", "solution": ["So $x=2$."], "final_answer": ["$2$"], "unit": None}
    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", lambda *a, **k: calls.append(a) or [olymp])
    ex = load_examples(DataConfig(name="olympiadbench", split="test"))[0]
    assert calls == [("Hothan/OlympiadBench", "OE_TO_maths_en_COMP")] and ex["ground_truth"] == "$2$"
    assert ex["question"] == "Find x." and ex["task"] == "math"
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        load_examples(DataConfig(hf="someone/x"))


def test_mixture_concatenates_sources_then_shuffles_and_limits():
    mix = DataConfig(mix=[DataConfig(name="countdown", split="test", limit=5), DataConfig(name="sudoku", split="test", limit=3)])
    examples = load_examples(mix)
    assert [e["task"] for e in examples] == ["countdown"] * 5 + ["sudoku"] * 3
    shuffled = load_examples(DataConfig(mix=mix.mix, shuffle_seed=1, limit=6))
    assert len(shuffled) == 6 and {e["id"] for e in shuffled} <= {e["id"] for e in examples}
    assert [e["id"] for e in shuffled] != [e["id"] for e in examples[:6]]
    with pytest.raises(ValueError, match="either mix"):
        DataConfig(name="gsm8k", mix=mix.mix)


def test_bytes_that_are_not_utf8_name_file_row_and_line(tmp_path):
    good = json.dumps({"question": "q", "answer": "#### 1"}).encode()
    (tmp_path / "latin.jsonl").write_bytes(good + b"\n" + b'{"question": "caf\xe9", "answer": "#### 2"}\n' + good + b"\n")
    with pytest.raises(DataError, match=r"latin\.jsonl, row 1 \(line 2\): not UTF-8 text \(byte 0xe9"):
        load_examples(DataConfig(path=str(tmp_path / "latin.jsonl")))
    assert len(load_examples(DataConfig(path=str(tmp_path / "latin.jsonl"), on_bad_row="skip"))) == 2
    (tmp_path / "latin.csv").write_bytes(b"Puzzle,Solution\n3102200002100320,3142243142131324\n\xff,x\n")
    with pytest.raises(DataError, match=r"latin\.csv \(line 3\): not UTF-8 text"):
        load_examples(DataConfig(path=str(tmp_path / "latin.csv")))
    (tmp_path / "latin.json").write_bytes(b'[\n{"question": "q", "answer": "#### 1"},\n{"question": "\xff"}]')
    with pytest.raises(DataError, match=r"latin\.json \(line 3\): not UTF-8 text"):
        load_examples(DataConfig(path=str(tmp_path / "latin.json")))


def test_a_lone_surrogate_names_its_row_and_field_and_a_device_is_not_a_data_file(tmp_path):
    # "\ud800" without its pair is valid JSON that decodes to no text (a tokenizer raised a TypeError on it);
    # a pair ("\ud83d\ude00": an emoji) is text.
    rows = ['{"question": "q \\ud83d\\ude00", "answer": "#### 1"}', '{"question": "a\\ud800b", "answer": "#### 2"}',
            '{"question": "q", "answer": "#### 3"}']
    path = _write(tmp_path / "sur.jsonl", rows)
    with pytest.raises(DataError, match=r"sur\.jsonl, row 1 \(line 2\): field 'question' holds a lone UTF-16 "
                                        r"surrogate \(\\ud800 at character 2\), which is not text$"):
        load_examples(DataConfig(path=str(path)))
    kept = load_examples(DataConfig(path=str(path), on_bad_row="skip"))
    assert [e["ground_truth"] for e in kept] == ["1", "3"] and kept[0]["question"] == "q \U0001f600"
    (tmp_path / "sur.json").write_text("[" + ", ".join(rows) + "]")
    with pytest.raises(DataError, match=r"sur\.json, row 1: field 'question' holds a lone UTF-16 surrogate"):
        load_examples(DataConfig(path=str(tmp_path / "sur.json")))
    from dare.data.readers import _lone_surrogate
    assert _lone_surrogate({"turns": [{"text": "ok"}, {"text": "x\ud800"}]}).startswith("field 'turns[1].text' holds")
    with pytest.raises(DataError, match=r"data file /dev/zero is not a regular file \(a device, pipe or socket\)"):
        load_examples(DataConfig(path="/dev/zero"))


def test_skip_policy_skips_lines_that_are_not_json_objects(tmp_path, caplog):
    # docs/data.md: on_bad_row: skip leaves out broken JSON too (it used to stop the load with an error)
    path = _write(tmp_path / "broken.jsonl", [json.dumps({"question": "a", "answer": "#### 1"}), "{not json", "[1, 2]",
                                              json.dumps({"question": "c", "answer": "#### 3"})])
    with caplog.at_level(logging.WARNING, logger="dare.data"):
        ex = load_examples(DataConfig(path=str(path), on_bad_row="skip"))
    assert [e["ground_truth"] for e in ex] == ["1", "3"] and [e["index"] for e in ex] == [0, 3]  # ids do not shift
    assert "broken.jsonl, row 1 (line 2): invalid JSON" in caplog.text and "row 2 (line 3): expected a JSON object" in caplog.text


def test_a_huge_field_is_never_echoed_in_full(tmp_path, caplog):
    huge = "1" * (1 << 20)
    path = _write(tmp_path / "huge.jsonl", [json.dumps({"Puzzle": huge, "Solution": "3142243142131324"}),
                                            json.dumps({"Puzzle": "3102200002100320", "Solution": "3142243142131324"})])
    with pytest.raises(DataError) as err:
        load_examples(DataConfig(path=str(path)))
    assert "huge.jsonl, row 0 (line 1): sudoku puzzle must have 16" in str(err.value) and len(str(err.value)) < 1000
    with caplog.at_level(logging.WARNING, logger="dare.data"):
        assert len(load_examples(DataConfig(path=str(path), on_bad_row="skip"))) == 1
    assert 0 < len(caplog.text) < 3000
    with pytest.raises(DataError, match=r"huge\.csv \(near line 2\): malformed CSV: field larger than field limit"):
        load_examples(DataConfig(path=str(_write(tmp_path / "huge.csv", ["Puzzle,Solution", f"{huge},3"]))))
    pairs = _write(tmp_path / "pairs.jsonl", [json.dumps({"prompt": ["x" * (1 << 20)], "response": "y"})])
    from dare.trainer.data import load_sft_docs
    from dare.trainer.recipe import DataSection
    from dare.models import tiny_tokenizer
    with pytest.raises(DataError, match="must be a string") as err:
        load_sft_docs(DataSection(pairs=str(pairs)), tiny_tokenizer())
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("file,rows,script", GENERATED)
def test_generated_files_are_readable_by_bundled_path_and_reproducible(file, rows, script, tmp_path):
    """A generated bundled file is named ``bundled:<path>`` in recipes, and its script remakes it byte for byte."""
    import subprocess
    from pathlib import Path

    from dare.data.readers import read_records, resolve_data_path

    assert resolve_data_path(f"bundled:{file}") == ASSETS / file
    assert sum(1 for _ in read_records(f"bundled:{file}")) == int(rows)
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / Path(file).name
    subprocess.run([sys.executable, str(root / script), "--out", str(out)], check=True, capture_output=True)
    assert out.read_bytes() == (ASSETS / file).read_bytes()


def test_a_process_parses_a_file_once_and_hands_out_copies(tmp_path, monkeypatch):
    """dare/data/parsed.py: a shuffled load parses every row; the next load of the same file (another seed, limit or
    none) reuses the parse and gives what a fresh parse gives; an example a caller changes does not reach the next
    load; another file content parses again."""
    import dare.data.loading as loading
    from dare.data import parsed
    parses = []
    original = loading.iter_examples
    monkeypatch.setattr(loading, "iter_examples", lambda cfg, policy=None: parses.append(cfg) or original(cfg, policy))
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(12)]
    path = _write(tmp_path / "q.jsonl", rows)
    cfg = DataConfig(path=str(path), shuffle_seed=1, limit=5)
    first = load_examples(cfg)
    again = [load_examples(DataConfig(path=str(path), shuffle_seed=s, limit=n)) for s, n in [(1, 5), (2, 3), (2, None)]]
    assert len(parses) == 1 and again[0] == first and len(again[2]) == 12
    first[0]["ground_truth"] = "changed"
    assert load_examples(cfg)[0]["ground_truth"] != "changed"
    parsed.clear()
    fresh = [load_examples(DataConfig(path=str(path), shuffle_seed=s, limit=n)) for s, n in [(1, 5), (2, 3), (2, None)]]
    assert fresh == again and len(parses) == 2
    _write(path, rows[:6] + [json.dumps({"question": "new", "answer": "#### 99"})] + rows[7:])  # same size, new bytes
    assert "99" in [e["ground_truth"] for e in load_examples(DataConfig(path=str(path), shuffle_seed=2))]
    assert len(parses) == 3
    # the template (or any field that shapes parsing) is part of the key; a hub dataset is never kept
    load_examples(DataConfig(path=str(path), shuffle_seed=2, task="math"))
    assert len(parses) == 4 and parsed.key(DataConfig(hf="org/name"), parsed.source_file(DataConfig(hf="org/name"))) is None


def test_a_file_with_skipped_rows_is_parsed_and_reported_each_time(tmp_path, caplog):
    path = _write(tmp_path / "mixed.jsonl", [json.dumps({"question": "a", "answer": "#### 1"}), json.dumps({"question": "b"})])
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dare.data"):
            assert len(load_examples(DataConfig(path=str(path), on_bad_row="skip", shuffle_seed=0))) == 1
        assert "skipped 1 bad row" in caplog.text
