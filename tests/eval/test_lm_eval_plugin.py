"""The lm-evaluation-harness plugin on a tiny model, fully offline, with local YAML tasks.

lm-eval is part of the dev extra (the test command installs it), so these tests fail rather than skip without it.
"""
import json

import lm_eval
import pytest
import torch

from dare.diffusion.noise import derive_seed
from dare.eval import register_lm_eval
from dare.eval.likelihood import elbo_loglikelihood
from dare.rollout import SamplerConfig, generate

MC = [{"question": "2+2=", "choices": ["4", "5", "66"], "label": 0},
      {"question": "3+3=", "choices": ["7", "6", "9"], "label": 1},
      {"question": "1+1=", "choices": ["3", "41", "2"], "label": 2},
      {"question": "5-1=", "choices": ["4", "0"], "label": 0}]
GEN = [{"question": "2+2=", "answer": "4"}, {"question": "9-3=", "answer": "6"}]


def _tasks(tmp_path):
    for name, rows in (("mc", MC), ("gen", GEN)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ntest_split: test\ndoc_to_text: \"{{{{question}}}}\"\n"
    (tmp_path / "tiny_mc.yaml").write_text(
        f"task: dare_tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (tmp_path / "tiny_gen.yaml").write_text(
        f"task: dare_tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"9\"]\n"
        "  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


@pytest.mark.integration
def test_simple_evaluate_offline_on_local_tasks(tmp_path, monkeypatch, tiny_llada, tiny_tok, one_thread):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    _tasks(tmp_path)
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    DareLM = register_lm_eval()
    assert get_model("dare") is DareLM
    sampler = SamplerConfig(gen_length=8, block_length=8, steps=8)
    lm = DareLM(model=tiny_llada, tokenizer=tiny_tok, sampler=sampler, mc_num=6, seed=3)
    out = lm_eval.simple_evaluate(model=lm, tasks=["dare_tiny_mc", "dare_tiny_gen"], bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                  log_samples=True)
    # Multiple choice: every choice scored by the ELBO with the request's own seed; acc follows from those numbers.
    expected_correct = []
    for doc, sample in zip(MC, sorted(out["samples"]["dare_tiny_mc"], key=lambda s: s["doc_id"])):
        lls = [r[0][0] for r in sample["resps"]]
        for choice, ll in zip(doc["choices"], lls):
            ctx = tiny_tok(doc["question"], add_special_tokens=False)["input_ids"]
            whole = tiny_tok(doc["question"] + " " + choice, add_special_tokens=False)["input_ids"]
            gen = torch.Generator().manual_seed(derive_seed(3, "lm-eval", "ll", doc["question"], " " + choice))
            assert ll == pytest.approx(elbo_loglikelihood(tiny_llada, whole[:len(ctx)], whole[len(ctx):], mc_num=6,
                                                          generator=gen), abs=1e-6)
        expected_correct.append(max(range(len(lls)), key=lls.__getitem__) == doc["label"])
    assert out["results"]["dare_tiny_mc"]["acc,none"] == pytest.approx(sum(expected_correct) / len(MC))
    # Generation: our sampler's decode of the prompt with its seed, cut at the first "until" string.
    for doc, sample in zip(GEN, sorted(out["samples"]["dare_tiny_gen"], key=lambda s: s["doc_id"])):
        ids = tiny_tok(doc["question"], add_special_tokens=False)["input_ids"]
        cfg = SamplerConfig(gen_length=8, block_length=8, steps=8)
        text = generate(tiny_llada, [ids], cfg, seeds=[derive_seed(3, "lm-eval-gen", doc["question"])]).texts(tiny_tok)[0]
        assert sample["resps"][0][0] == text.split("9")[0]
    assert 0.0 <= out["results"]["dare_tiny_gen"]["exact_match,none"] <= 1.0


@pytest.mark.integration
def test_dare_eval_command_runs_lm_eval_tasks(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    _tasks(tmp_path)
    from dare.cli import main

    out = tmp_path / "run"
    assert main(["eval", "--model", "tiny:sdar", "--benchmarks", "", "--lm-eval-tasks", "dare_tiny_mc,dare_tiny_gen",
                 "--lm-eval-include-path", str(tmp_path), "--mc-num", "4", "--gen-length", "8", "--block-length", "4",
                 "--output-dir", str(out), "--no-progress"]) == 0
    benches = json.loads((out / "results.json").read_text())[0]["benchmarks"]
    res = benches["dare_tiny_mc"]
    assert res["metric"] == "acc" and 0.0 <= res["score"] <= 100.0 and "acc" in res["lm_eval"]
    assert "tpf" not in res  # loglikelihood requests decode nothing
    # Generative lm-eval tasks report speed like built-in benchmarks: max_gen_toks 6 -> 8 tokens (two blocks of 4),
    # one token per step on this random model, plus a block model's storing forwards: TPF below one.
    gen = benches["dare_tiny_gen"]
    assert gen["nfe_per_sample"] >= 8 and 0 < gen["tpf"] <= 1 and gen["tokens_per_second"] > 0
    table = (out / "results.md").read_text()
    assert "dare_tiny_mc" in table and "| tiny-sdar | dare_tiny_gen |" in table


def test_plugin_argument_errors(tiny_llada, tiny_tok):
    DareLM = register_lm_eval()
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['gen_len'\]"):
        DareLM(model=tiny_llada, tokenizer=tiny_tok, gen_len=4)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        DareLM(model=tiny_llada)
    lm = DareLM(model=tiny_llada, tokenizer=tiny_tok, gen_length=16, block_length=8, steps=16)
    cfg = lm._sampler_for({"max_gen_toks": 20, "temperature": 0.5})
    assert (cfg.gen_length, cfg.steps, cfg.temperature) == (24, 24, 0.5)
    # Word-boundary spaces move from the context to the continuation; an empty context gets a prefix token.
    ctx, cont = lm._pair("Q: 2+2= ", "4")
    assert tiny_tok.decode(cont) == " 4" and tiny_tok.decode(ctx) == "Q: 2+2="
    assert lm._pair("", "hi")[0] == [tiny_tok.bos_token_id]


def test_plugin_decodes_with_the_checkpoints_settings_unless_model_args_say_otherwise():
    from dare.quickstart.assets import get_checkpoint
    DareLM = register_lm_eval()
    path = str(get_checkpoint("lazy-sudoku-llada-sft").path)  # dare_decoding.json: 40 tokens, one block, 40 steps
    lm = DareLM(pretrained=path, device="cpu")
    assert (lm.sampler.gen_length, lm.sampler.block_length, lm.sampler.steps) == (40, 40, 40)
    given = DareLM(pretrained=path, device="cpu", gen_length=16, block_length=8)
    assert (given.sampler.gen_length, given.sampler.block_length) == (16, 8)
    assert given.sampler.steps == SamplerConfig().steps  # a length given by hand frees the checkpoint's schedule


def test_dare_eval_indexes_lm_evals_own_tasks_only_when_a_task_needs_them():
    """Indexing lm-eval's task folder takes ~15 s: with an include path whose tasks are all the run asks for, dare
    eval indexes that folder alone; a task (or a group, which may name lm-eval's tasks) from elsewhere gets both."""
    from dare.commands.eval import task_manager
    built = []

    class Manager:
        def __init__(self, include_path=None, include_defaults=True):
            built.append((include_path, include_defaults))
            self.all_subtasks = ["mine_a", "mine_b"] + (["gsm8k"] if include_defaults else [])

    assert task_manager(Manager, "my_tasks", ["mine_a", "mine_b"]).all_subtasks == ["mine_a", "mine_b"]
    assert built == [("my_tasks", False)]
    for tasks in (["mine_a", "gsm8k"], ["my_group"]):
        built.clear()
        assert "gsm8k" in task_manager(Manager, "my_tasks", tasks).all_subtasks
        assert built == [("my_tasks", False), ("my_tasks", True)]
    built.clear()
    task_manager(Manager, None, ["gsm8k"])
    assert built == [(None, True)]


@pytest.mark.integration
def test_dare_lm_eval_runs_lm_evals_own_command_line_with_the_dare_model(tmp_path, monkeypatch, capsys):
    # `lm_eval --model dare` finds no model (lm-eval imports no other package's modules); `dare lm-eval` registers
    # it and hands lm-eval's own arguments to lm-eval's own CLI, here on a task YAML written by the test.
    from dare.cli import main
    from dare.quickstart.assets import get_checkpoint
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    _tasks(tmp_path)
    ckpt = get_checkpoint("lazy-sudoku-llada-sft").path
    assert main(["lm-eval", "--model", "dare", "--model_args", f"pretrained={ckpt},gen_length=8,block_length=8", "--device", "cpu",
                 "--tasks", "dare_tiny_gen", "--include_path", str(tmp_path), "--limit", "2",
                 "--output_path", str(tmp_path / "out")]) == 0
    (result,) = (tmp_path / "out").rglob("results_*.json")
    metrics = json.loads(result.read_text())["results"]["dare_tiny_gen"]
    assert "exact_match,none" in metrics and json.loads(result.read_text())["config"]["model"] == "dare"
