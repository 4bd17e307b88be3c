"""Prompt templates, chat rendering, SFT targets and the countdown solver."""
import itertools
import logging
import re
from fractions import Fraction

import pytest

from dare.data import (DATASETS, DataConfig, DataError, TEMPLATES, build_prompts, build_sft_example, get_template,
                       load_examples, render_prompt, solve_countdown)
from dare.data.tasks import eval_countdown
from dare.models.tokenizer import load_tokenizer, tiny_tokenizer
from tests.conftest import TOKENIZERS

DARE_FILES = [(n, s) for n, spec in DATASETS.items() for s, f in spec.files.items() if f.startswith("dare/")]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("name,split", DARE_FILES, ids=[f"{n}-{s}" for n, s in DARE_FILES])
def test_dare_template_reproduces_the_parquet_prompts_exactly(name, split):
    tpl = get_template("dare")
    examples = load_examples(DataConfig(name=name, split=split, limit=600))
    for ex in examples:
        p = tpl.build(ex)
        rebuilt = p.messages + ([{"role": "assistant", "content": p.generation_prefix}] if p.generation_prefix else [])
        assert rebuilt == ex["messages"], ex["id"]


def test_every_template_covers_every_task_of_every_benchmark(tok):
    for name, spec in DATASETS.items():
        if "test" not in spec.files:
            continue  # Hub-only datasets
        ex = load_examples(DataConfig(name=name, split="test", limit=1))[0]
        for tpl in TEMPLATES:
            text = render_prompt(ex, tpl, tok)
            assert text.strip()
            if ex["task"] != "code":  # raw problem text reaches the prompt (code: the prefix / asserts do)
                gt = ex["ground_truth"]
                key = {"countdown": lambda: str(gt["target"]), "sudoku": lambda: gt["puzzle"]}
                assert key.get(ex["task"], lambda: ex["question"][:30])() in text


def test_chat_template_is_applied_when_the_tokenizer_has_one(tok):
    ex = load_examples(DataConfig(name="gsm8k", split="test", limit=1))[0]
    text = render_prompt(ex, "reasoning", tok)
    assert text.startswith("<|user|>You are a math expert") and text.endswith("<|eot|><|assistant|>")
    assert ex["question"] in text and "<reasoning>" in text
    plain = render_prompt(ex, "reasoning", tok, chat_template="never")
    assert "<|user|>" not in plain and ex["question"] in plain
    with_sys = render_prompt(ex, "reasoning", tok, system_prompt="Be brief.")
    assert with_sys.startswith("<|system|>Be brief.<|eot|><|user|>")
    pref = render_prompt(ex, "reasoning", tok, generation_prefix="<reasoning>")
    assert pref.endswith("<|assistant|><reasoning>")
    dream = load_tokenizer(TOKENIZERS / "dream-v0-instruct")
    text = render_prompt(ex, "reasoning", dream)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    # base-model template never uses the chat template; HumanEval becomes a code prefix to continue
    he = load_examples(DataConfig(name="humaneval", split="test", limit=1))[0]
    assert render_prompt(he, "plain", dream) == he["ground_truth"]["prefix"]
    nochat = tiny_tokenizer()
    nochat.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(ex, "reasoning", nochat, chat_template="always")


def test_compact_sudoku_is_short_for_the_tiny_tokenizer(tok):
    ex = load_examples(DataConfig(name="sudoku", split="train", limit=1))[0]
    prompt, completion = build_sft_example(ex, "compact", tok)
    assert prompt == f"<|user|>{ex['ground_truth']['puzzle']}<|eot|><|assistant|>"
    assert completion == f"<answer>{ex['ground_truth']['solution']}</answer>"
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) == 19
    assert len(tok(completion, add_special_tokens=False)["input_ids"]) == 33


def _answer(text):
    return re.findall(r"<answer>\n?(.*?)\n?</answer>", text, re.S)[-1]


@pytest.mark.parametrize("template", ["compact", "reasoning", "dare"])
def test_countdown_sft_targets_are_valid_expressions(template, tok):
    examples = load_examples(DataConfig(name="countdown", split="train", limit=300))
    for ex in examples:
        _, completion = build_sft_example(ex, template, tok)
        expr = _answer(completion)
        gt = ex["ground_truth"]
        assert eval_countdown(expr) == gt["target"], (ex["id"], expr)
        assert sorted(int(n) for n in re.findall(r"\d+", expr)) == sorted(gt["numbers"])
    # the reasoning format replays the arithmetic step by step
    _, completion = build_sft_example(examples[0], "reasoning", tok)
    assert re.fullmatch(r"<reasoning>\n(.+ = .+\n)+</reasoning>\n<answer>\n.+\n</answer>", completion)


def test_math_and_sudoku_sft_targets(tok):
    gsm = load_examples(DataConfig(name="gsm8k", split="test", limit=1))[0]
    _, c = build_sft_example(gsm, "reasoning", tok)
    assert c == "<reasoning>\n\n</reasoning>\n<answer>\n\\boxed{18}\n</answer>"
    with_solution = dict(gsm, solution="Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\n#### 18")
    _, c = build_sft_example(with_solution, "reasoning", tok)
    assert c.startswith("<reasoning>\nJanet sells 16 - 3 - 4 = 9 eggs.\n</reasoning>") and "<<" not in c
    sd = load_examples(DataConfig(name="sudoku", split="test", limit=1))[0]
    assert _answer(build_sft_example(sd, "reasoning", tok)[1]) == sd["ground_truth"]["solution"]


def test_code_sft_targets_pass_their_tests(tok):
    he = load_examples(DataConfig(name="humaneval", split="test", limit=3))
    for ex in he:
        prompt, completion = build_sft_example(ex, "plain", tok)
        exec(prompt + completion + "\n" + ex["ground_truth"]["tests"], {})
        _, fenced = build_sft_example(ex, "reasoning", tok)
        code = re.search(r"```python\n(.*?)```", fenced, re.S).group(1)
        exec(code + "\n" + ex["ground_truth"]["tests"], {})
    mbpp = load_examples(DataConfig(name="mbpp", split="test", limit=1))[0]
    with pytest.raises(DataError, match="no canonical_solution"):
        build_sft_example(mbpp, "dare", tok)


def test_max_prompt_tokens_policy(tok, caplog):
    examples = load_examples(DataConfig(name="gsm8k", split="test", limit=6))
    lengths = [len(p.input_ids) for p in build_prompts(examples, tok, DataConfig(name="gsm8k", template="compact"))]
    limit = sorted(lengths)[3]
    cfg = DataConfig(name="gsm8k", template="compact", max_prompt_tokens=limit)
    with pytest.raises(DataError, match=rf"example gsm8k/test/\d+ \(row \d+\): prompt has \d+ tokens, over max_prompt_tokens={limit}"):
        build_prompts(examples, tok, cfg)
    cfg.on_bad_row = "skip"
    with caplog.at_level(logging.WARNING, logger="dare.data"):
        kept = build_prompts(examples, tok, cfg)
    assert len(kept) == sum(n <= limit for n in lengths) and "over max_prompt_tokens" in caplog.text
    assert all(len(p.input_ids) <= limit for p in kept)


def test_chat_prompts_are_encoded_without_a_second_bos():
    dream = load_tokenizer(TOKENIZERS / "dream-v0-instruct")
    ex = load_examples(DataConfig(name="sudoku", split="test", limit=1))
    p = build_prompts(ex, dream, DataConfig(name="sudoku"))[0]
    assert dream.decode(p.input_ids) == p.text


def test_countdown_solver_is_exact_and_minimal():
    assert solve_countdown([1, 2, 3], 100) is None
    assert solve_countdown([8, 4, 2], 1) in ("8/4/2", "8/(4*2)", "2/(8/4)")
    assert eval_countdown(solve_countdown([3, 4, 5], -2)) == -2
    # exact rational arithmetic: 6/(1-3/4) = 24 needs a fraction on the way
    expr = solve_countdown([6, 1, 3, 4], 24)
    assert eval_countdown(expr) == 24
    # brute force agrees with an independent enumeration on random small cases
    for nums in itertools.islice(itertools.product(range(1, 6), repeat=3), 0, 125, 7):
        reachable = set()
        for a, b, c in itertools.permutations(nums):
            for o1, o2 in itertools.product("+-*/", repeat=2):
                for e in (f"({a}{o1}{b}){o2}{c}", f"{a}{o1}({b}{o2}{c})"):
                    v = eval_countdown(e)
                    if v is not None and v.denominator == 1:
                        reachable.add(int(v))
        for target in range(-5, 30):
            found = solve_countdown(list(nums), target)
            assert (found is not None) == (target in reachable), (nums, target)
            if found:
                assert eval_countdown(found) == Fraction(target) and "((" not in found
