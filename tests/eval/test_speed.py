"""Speed beside quality: per-sample NFE, tokens per forward (TPF) and tokens/s in rollouts, dare eval and dare generate."""
import json

import pytest
import torch

from dare.data import DataConfig, build_prompts, load_examples
from dare.eval import evaluate
from dare.models.model_spec import load_model_spec
from dare.eval.speed import speed_summary
from dare.quickstart.assets import get_checkpoint
from dare.rollout import SamplerConfig, generate


@pytest.fixture(scope="module")
def sdar_sudoku():
    """The shipped block-diffusion Sudoku checkpoint: trained, so threshold decoding commits several tokens a step
    and rows of one batch take different numbers of forwards."""
    model, tok = load_model_spec(str(get_checkpoint("lazy-sudoku-sdar-sft").path), device="cpu")
    cfg = DataConfig(name="sudoku", split="test", limit=6, template="compact")
    prompts = [p.input_ids for p in build_prompts(load_examples(cfg), tok, cfg)]
    return model, tok, prompts


def test_row_nfe_is_what_decoding_the_row_alone_costs(sdar_sudoku, one_thread):
    model, _, prompts = sdar_sudoku
    cfg = SamplerConfig(gen_length=40, block_length=4, cache="block", remasking="dynamic", threshold=0.7)
    batch = generate(model, prompts, cfg)
    alone = [generate(model, [p], cfg) for p in prompts]
    assert batch.row_nfe.tolist() == [int(a.row_nfe[0]) for a in alone] == [a.nfe for a in alone]
    assert batch.completion_ids.tolist() == [a.completion_ids[0].tolist() for a in alone]
    # Rows finish after different numbers of forwards; the batched count is set by the slowest row at least.
    assert len(set(batch.row_nfe.tolist())) > 1 and batch.nfe >= int(batch.row_nfe.max())
    # Threshold decoding commits several tokens per forward on this trained model: TPF above one.
    valid = batch.valid_lengths()
    assert float(valid.sum()) / float(batch.row_nfe.sum()) > 1.5


def test_valid_lengths_cut_at_the_first_stop_token(sdar_sudoku):
    model, _, prompts = sdar_sudoku
    r = generate(model, prompts[:2], SamplerConfig(gen_length=40, block_length=4))
    stop = set(r.stop_token_ids)
    for ids, n in zip(r.completion_ids.tolist(), r.valid_lengths().tolist()):
        first = next((j for j, t in enumerate(ids) if t in stop), len(ids))
        assert n == first and not stop & set(ids[:n])
    # One token per step, no cache: every committed token took one forward, so TPF <= 1.
    assert int(r.valid_lengths().sum()) <= int(r.row_nfe.sum())


def test_eval_results_report_nfe_tpf_and_throughput(tmp_path, sdar_sudoku, one_thread):
    model, tok, _ = sdar_sudoku
    cfg = SamplerConfig(gen_length=40, block_length=4, cache="block", remasking="dynamic", threshold=0.7)
    res = evaluate(model, tok, ["sudoku"], cfg, output_dir=tmp_path, limit=6, batch_size=4, template="compact",
                   progress=False, reward_workers=1)
    s = res["benchmarks"]["sudoku"]
    recs = [json.loads(line) for line in (tmp_path / "sudoku.jsonl").read_text().splitlines()]
    nfe = [r["nfe"] for r in recs]
    valid = [r["valid_tokens"] for r in recs]
    assert s["nfe_per_sample"] == pytest.approx(sum(nfe) / len(nfe), abs=1e-3)
    assert s["tpf"] == pytest.approx(sum(valid) / sum(nfe), abs=1e-4) and s["tpf"] > 1
    assert s["tokens_per_second"] > 0
    assert all(r["valid_tokens"] < r["completion_tokens"] <= 40 for r in recs)  # the stop token is not valid
    table = (tmp_path / "results.md").read_text()
    assert "| model | benchmark | score | NFE / sample | TPF | tokens/s |" in table
    assert f"| {s['nfe_per_sample']:.1f} | {s['tpf']:.2f} |" in table
    saved = json.loads((tmp_path / "results.json").read_text())["benchmarks"]["sudoku"]
    assert saved["tpf"] == s["tpf"] and saved["nfe_per_sample"] == s["nfe_per_sample"]


def test_speed_summary_leaves_out_records_without_counts():
    recs = [{"nfe": 10, "valid_tokens": 30}, {"nfe": 20, "valid_tokens": 10}, {"score": 1.0}]  # an older record
    s = speed_summary(recs, run_seconds=2.0, run_tokens=40)
    assert s == {"nfe_per_sample": 15.0, "tpf": pytest.approx(40 / 30, abs=1e-4), "valid_tokens_per_sample": 20.0,
                 "tokens_per_second": 20.0}
    assert speed_summary([{"score": 0.0}]) == {"nfe_per_sample": None, "tpf": None, "valid_tokens_per_sample": None,
                                               "tokens_per_second": None}


def test_generate_command_reports_per_sample_nfe_and_tpf(capsys):
    from dare.cli import main

    path = str(get_checkpoint("lazy-sudoku-sdar-sft").path)
    assert main(["generate", "--model", path, "--prompt-ids", "5,17,42", "--prompt-ids", "7,8", "--gen-length", "16",
                 "--block-length", "4", "--cache", "block", "--threshold", "0.5", "--remasking", "dynamic", "--json",
                 "--device", "cpu"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["completions"]
    assert res["nfe_per_sample"] == pytest.approx(sum(r["nfe"] for r in rows) / len(rows), abs=1e-3)
    assert res["tpf"] == pytest.approx(sum(r["valid_tokens"] for r in rows) / sum(r["nfe"] for r in rows), abs=1e-4)
    assert all(r["tpf"] == pytest.approx(r["valid_tokens"] / r["nfe"], abs=1e-4) for r in rows)
    assert res["nfe"] >= max(r["nfe"] for r in rows) and res["tokens_per_second"] > 0
    assert torch.tensor([r["valid_tokens"] for r in rows]).sum() == res["valid_tokens"]
