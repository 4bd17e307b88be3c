"""OpenCompass as a real client: the documented two-command set-up, then GSM8K end to end on a tiny checkpoint.

Command 1 (``bash scripts/setup_opencompass.sh``) builds OpenCompass's own environment, .venv-oc (about 8 minutes
the first time, seconds once built); command 2 runs ``opencompass recipes/eval/opencompass_gsm8k.py`` offline. The
same examples go through ``dare eval`` with the same prompt (``--template dare``: the bare question as the user turn),
and OpenCompass's predictions, its summary table and its scorer are checked against dare's records.
"""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dare.cli import main
from dare.data import DataConfig, load_examples
from dare.quickstart.assets import get_checkpoint
from dare.rewards import score_batch

ROOT = Path(__file__).resolve().parents[2]
OC_PY = ROOT / ".venv-oc" / "bin" / "python"
LIMIT, GEN = 4, 16

# OpenCompass's own GSM8K scorer (the config's pred_postprocessor + evaluator), run inside .venv-oc on texts
# read from stdin: what OpenCompass would report for dare eval's completions.
# The same process grades the grader-parity corpus (tests/rewards/test_grader_parity.py) answer by answer.
OC_SCORE = """
import json, sys
from opencompass.datasets import Gsm8kEvaluator, gsm8k_postprocess
given = json.load(sys.stdin)
rows, evaluator = given["rows"], Gsm8kEvaluator()
preds = [gsm8k_postprocess(r["completion"]) for r in rows]
print(json.dumps([bool(evaluator.is_equal(gsm8k_postprocess(c), g)) for c, g in given["parity"]]))
print(json.dumps(evaluator.score(preds, [r["ground_truth"] for r in rows])["accuracy"]))
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _unpinned() -> list[str]:
    """Packages of .venv-oc (but torch, dare and the installers) at a version the constraints file does not pin: the
    install would not resolve the same way next time."""
    pins = {_normal(n): v for n, v in (line.split("==") for line in
            (ROOT / "scripts" / "opencompass-constraints.txt").read_text().splitlines() if "==" in line)}
    freeze = subprocess.run([str(OC_PY), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout.split()
    installed = dict(line.split("==") for line in freeze if "==" in line)
    return sorted(f"{n}=={v}" for n, v in installed.items()
                  if _normal(n) not in {"torch", "dare", "pip", "setuptools", "wheel"} and pins.get(_normal(n)) != v)


@pytest.mark.integration
def test_opencompass_gsm8k_matches_dare_eval(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_opencompass.sh")], check=True, cwd=ROOT)
    assert _unpinned() == [], "installed in .venv-oc but not pinned by scripts/opencompass-constraints.txt"
    ckpt = str(get_checkpoint("lazy-sudoku-llada-sft").path)
    data = tmp_path / "gsm8k"
    data.mkdir()
    examples = load_examples(DataConfig(name="gsm8k", split="test", limit=LIMIT))
    rows = [json.dumps({"question": e["question"], "answer": f"#### {e['ground_truth']}"}) + "\n" for e in examples]
    (data / "test.jsonl").write_text("".join(rows))
    (data / "train.jsonl").write_text(rows[0])  # the loader reads both splits; the zero-shot prompt uses neither

    out = tmp_path / "dare"
    assert main(["eval", "--model", ckpt, "--benchmarks", "gsm8k", "--limit", str(LIMIT), "--template", "dare",
                 "--gen-length", str(GEN), "--block-length", str(GEN), "--batch-size", "1", "--dtype", "float32",
                 "--device", "cpu", "--output-dir", str(out), "--no-progress", "--reward-workers", "1"]) == 0
    ours = [json.loads(line) for line in (out / Path(ckpt).name / "gsm8k.jsonl").read_text().splitlines()]
    ours.sort(key=lambda r: r["index"])

    env = dict(os.environ, DARE_MODEL=ckpt, DARE_DTYPE="float32", DARE_NUM_GPUS="0", DARE_GEN_LENGTH=str(GEN),
               DARE_BLOCK_LENGTH=str(GEN), DARE_BATCH_SIZE="1", DARE_LIMIT=str(LIMIT), DARE_PROMPT="dare",
               DARE_GSM8K_DIR=str(data), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    work = tmp_path / "oc"
    run = subprocess.run([str(OC_PY.parent / "opencompass"), str(ROOT / "recipes/eval/opencompass_gsm8k.py"), "-w",
                          str(work), "--debug"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (stamp,) = [p for p in work.iterdir() if p.is_dir()]
    preds = json.loads((stamp / "predictions" / Path(ckpt).name / "gsm8k.json").read_text())
    # The same prompts decode to the same completions in both harnesses.
    assert [preds[str(i)]["origin_prompt"] for i in range(LIMIT)] == [e["question"] for e in examples]
    assert [preds[str(i)]["prediction"] for i in range(LIMIT)] == [r["completion"] for r in ours]
    # OpenCompass's summary table holds what its own scorer gives dare eval's completions.
    (summary,) = (stamp / "summary").glob("summary_*.md")
    row = next(line for line in summary.read_text().splitlines() if line.startswith("| gsm8k "))
    table_acc = float(row.strip("| ").split("|")[-1])
    from tests.rewards.test_grader_parity import opencompass_row, opencompass_disagreements
    from tests.rewards.grader_parity_corpus import GSM8K
    scored = subprocess.run([str(OC_PY), "-c", OC_SCORE], capture_output=True, text=True, check=True, env=env,
                            input=json.dumps({"rows": ours, "parity": [[c, g] for _, g, c in GSM8K]}))
    parity, accuracy = scored.stdout.strip().splitlines()[-2:]
    assert table_acc == pytest.approx(float(accuracy), abs=0.01)
    # Grader parity with OpenCompass's GSM8K rule: every disagreement listed, the docs row this run's counts.
    verdicts = json.loads(parity)
    found, listed = opencompass_disagreements(verdicts)
    assert found == listed, (found, listed)
    assert opencompass_row(verdicts) in (ROOT / "docs" / "rewards.md").read_text(), opencompass_row(verdicts)
    details = json.loads((stamp / "results" / Path(ckpt).name / "gsm8k.json").read_text())["details"]
    assert [d["answer"][0] for d in details] == [e["ground_truth"] for e in examples]
    # And the other way round: dare's math reward on OpenCompass's predictions gives dare eval's scores.
    theirs = score_batch("auto", [preds[str(i)]["prediction"] for i in range(LIMIT)], examples, workers=1)
    assert [r.score for r in theirs] == [r["score"] for r in ours]
