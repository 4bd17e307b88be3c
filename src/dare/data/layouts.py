"""Row layouts: how the raw records of each known file format become normalised examples.

A layout is detected once per file from the first record's columns (or named with ``format:``), then
applied to every row, so a malformed row is reported rather than silently parsed another way.

| layout      | columns                                                        | origin                       |
|-------------|----------------------------------------------------------------|------------------------------|
| ``dare``    | data_source, prompt (chat list), reward_model, extra_info      | DARE / verl preprocessed     |
| ``humaneval``| task_id, prompt, test, entry_point (canonical_solution)       | openai/human-eval            |
| ``mbpp``    | text or prompt, test_list (code, test_setup_code)              | google-research MBPP         |
| ``countdown``| input ("30,100,93") + output, or nums + target                | d1 / Jiayi-Pan Countdown     |
| ``sudoku``  | Puzzle, Solution (16 chars, 0 = empty)                         | d1 4x4 sudoku CSV            |
| ``gsm8k``   | question, answer (worked solution ending ``#### N``)           | openai/grade-school-math     |
| ``qa``      | problem or question, answer (or solution with ``\\boxed``)     | MATH-500, AIME, generic math |
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import tasks
from .readers import Record
from .schema import DataError, shown


@dataclass
class Context:
    """What a parser needs besides the row: id prefix, dataset short name and a task override."""
    id_prefix: str
    source: str
    task: Optional[str] = None


def _fail(rec: Record, msg: str):
    raise DataError(f"{rec.loc}: {msg}")


def _field(rec: Record, *names: str, required: bool = True) -> Any:
    for name in names:
        if name in rec.data and rec.data[name] is not None:
            return rec.data[name]
    if required:
        _fail(rec, f"missing field {' or '.join(repr(n) for n in names)}")
    return None


def _literal(rec: Record, value: Any, name: str) -> Any:
    """Cells that verl/DARE stored as Python-literal (or JSON) strings instead of nested values."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text or text[0] not in "[{(":
        return value
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        _fail(rec, f"field {name!r} looks like a list/dict but is not a valid literal: {e}")


def _str(rec: Record, value: Any, name: str) -> str:
    if not isinstance(value, str):
        _fail(rec, f"field {name!r} must be a string, got {type(value).__name__} {shown(value)}")
    return value


def _int(rec: Record, value: Any, name: str) -> int:
    if isinstance(value, bool):
        _fail(rec, f"field {name!r} must be an integer, got {shown(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        return int(value)
    _fail(rec, f"field {name!r} must be an integer, got {shown(value)}")


def _int_list(rec: Record, value: Any, name: str) -> list[int]:
    value = _literal(rec, value, name)
    if isinstance(value, str):  # d1: "30,100,93"
        value = [v for v in re.split(r"[,\s]+", value.strip()) if v]
    if not isinstance(value, (list, tuple)) or not value:
        _fail(rec, f"field {name!r} must be a non-empty list of integers, got {shown(value)}")
    return [_int(rec, v, name) for v in value]


def _base(rec: Record, ctx: Context, task: str, question: str, gt: Any, **extra) -> dict:
    ex = {"id": f"{ctx.id_prefix}/{rec.row}", "task": ctx.task or task, "question": question, "ground_truth": gt,
          "source": ctx.source, "index": rec.row}
    ex.update({k: v for k, v in extra.items() if v is not None})
    return ex


# --- DARE parquet ------------------------------------------------------------------------------------
_HUMANEVAL_HEADER = "Complete the following python code:\n"
_MBPP_HEADER = "You are an expert Python programmer, and here is your task: "


def _messages(rec: Record) -> list[dict]:
    msgs = _literal(rec, _field(rec, "prompt"), "prompt")
    if isinstance(msgs, str):
        return [{"role": "user", "content": msgs}]
    if not isinstance(msgs, (list, tuple)) or not msgs:
        _fail(rec, f"field 'prompt' must be a chat message list, got {type(msgs).__name__}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            _fail(rec, f"prompt[{i}] must be a {{role, content}} message, got {shown(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def parse_dare(rec: Record, ctx: Context) -> dict:
    data_source = str(_field(rec, "data_source", required=False) or "")
    reward = _literal(rec, _field(rec, "reward_model"), "reward_model")
    if not isinstance(reward, dict) or "ground_truth" not in reward:
        _fail(rec, "field 'reward_model' must be a mapping with a 'ground_truth'")
    gt_raw = reward["ground_truth"]
    info = _literal(rec, _field(rec, "extra_info", required=False) or {}, "extra_info")
    if not isinstance(info, dict):
        _fail(rec, f"field 'extra_info' must be a mapping, got {type(info).__name__}")
    msgs = _messages(rec)
    user = [m["content"] for m in msgs if m["role"] == "user"]
    if not user:
        _fail(rec, "prompt has no user message")
    common = {"messages": msgs, "data_source": data_source}
    source = data_source.lower()
    if "numbers" in info or source.startswith("countdown"):
        numbers = _int_list(rec, info.get("numbers"), "extra_info.numbers")
        target = _int(rec, gt_raw, "reward_model.ground_truth")
        return _base(rec, ctx, "countdown", tasks.countdown_question(numbers, target),
                     {"numbers": numbers, "target": target}, **common)
    if "puzzle" in info or source.startswith("sudoku"):
        puzzle = _str(rec, info.get("puzzle"), "extra_info.puzzle")
        return _base(rec, ctx, "sudoku", tasks.sudoku_question(puzzle),
                     {"puzzle": puzzle, "solution": _str(rec, gt_raw, "reward_model.ground_truth")}, **common)
    if info.get("task") == "code" or source.startswith(("humaneval", "mbpp")):
        gt = _literal(rec, gt_raw, "reward_model.ground_truth")
        if isinstance(gt, (list, tuple)):  # MBPP: a list of assert statements
            asserts = [_str(rec, t, "reward_model.ground_truth[]") for t in gt]
            question = user[-1][len(_MBPP_HEADER):] if user[-1].startswith(_MBPP_HEADER) else user[-1]
            code_gt = {"tests": "\n".join(asserts) + "\n", "entry_point": tasks.entry_point_from_asserts(asserts), "prefix": ""}
            return _base(rec, ctx, "code", question, code_gt, **common)
        test = _str(rec, gt, "reward_model.ground_truth")
        prefix = user[-1][len(_HUMANEVAL_HEADER):] if user[-1].startswith(_HUMANEVAL_HEADER) else user[-1]
        entry = tasks.last_top_level_def(prefix)
        if entry is None or "def check(" not in test:
            _fail(rec, "code row is neither MBPP asserts nor a HumanEval prompt with a check(candidate) test")
        return _base(rec, ctx, "code", prefix, {"tests": tasks.humaneval_tests(test, entry), "entry_point": entry,
                                                "prefix": prefix}, **common)
    question = info.get("question") if isinstance(info.get("question"), str) else user[-1]
    solution = info.get("answer") if isinstance(info.get("answer"), str) else None
    gt = _str(rec, gt_raw, "reward_model.ground_truth") if not isinstance(gt_raw, (int, float)) else str(gt_raw)
    return _base(rec, ctx, "math", question, gt.strip(), solution=solution, **common)


# --- original layouts --------------------------------------------------------------------------------
def parse_humaneval(rec: Record, ctx: Context) -> dict:
    prompt = _str(rec, _field(rec, "prompt"), "prompt")
    entry = _str(rec, _field(rec, "entry_point"), "entry_point")
    test = _str(rec, _field(rec, "test"), "test")
    return _base(rec, ctx, "code", prompt, {"tests": tasks.humaneval_tests(test, entry), "entry_point": entry, "prefix": prompt},
                 canonical_solution=rec.data.get("canonical_solution"), task_id=rec.data.get("task_id"))


def parse_mbpp(rec: Record, ctx: Context) -> dict:
    text = _str(rec, _field(rec, "text", "prompt"), "text")
    tests = _literal(rec, _field(rec, "test_list"), "test_list")
    if not isinstance(tests, (list, tuple)) or not tests:
        _fail(rec, "field 'test_list' must be a non-empty list of assert statements")
    tests = [_str(rec, t, "test_list[]") for t in tests]
    setup = rec.data.get("test_setup_code") or ""
    question = f"{text} Your code should pass these tests:\n\n" + "\n".join(tests) + "\n"
    code_gt = {"tests": (setup + "\n" if setup else "") + "\n".join(tests) + "\n",
               "entry_point": tasks.entry_point_from_asserts(tests), "prefix": ""}
    return _base(rec, ctx, "code", question, code_gt, canonical_solution=rec.data.get("code"), task_id=rec.data.get("task_id"))


def parse_countdown(rec: Record, ctx: Context) -> dict:
    numbers = _int_list(rec, _field(rec, "input", "nums", "numbers"), "input")
    target = _int(rec, _field(rec, "output", "target"), "output")
    return _base(rec, ctx, "countdown", tasks.countdown_question(numbers, target), {"numbers": numbers, "target": target})


def parse_sudoku(rec: Record, ctx: Context) -> dict:
    puzzle = _str(rec, _field(rec, "Puzzle", "puzzle"), "Puzzle").strip()
    solution = _str(rec, _field(rec, "Solution", "solution"), "Solution").strip()
    return _base(rec, ctx, "sudoku", tasks.sudoku_question(puzzle), {"puzzle": puzzle, "solution": solution})


def parse_gsm8k(rec: Record, ctx: Context) -> dict:
    question = _str(rec, _field(rec, "question"), "question")
    answer = _str(rec, _field(rec, "answer"), "answer")
    gold = tasks.gsm8k_final_answer(answer)
    if gold is None:
        _fail(rec, "GSM8K answer has no '#### N' final answer")
    return _base(rec, ctx, "math", question, gold, solution=answer)


def parse_qa(rec: Record, ctx: Context) -> dict:
    question = _str(rec, _field(rec, "problem", "question", "Problem", "Question"), "problem")
    answer = _field(rec, "answer", "Answer", "final_answer", required=False)
    solution = rec.data.get("solution")
    if isinstance(answer, (list, tuple)):  # OlympiadBench: final_answer is a list (several for multi-answer items)
        answer = ", ".join(str(a) for a in answer) if answer else None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(int(answer)) if float(answer).is_integer() else str(answer)
    if answer is None and isinstance(solution, str):
        answer = tasks.last_boxed(solution) or tasks.gsm8k_final_answer(solution)
    if answer is None:
        _fail(rec, "missing field 'answer' (and no \\boxed{} answer in 'solution')")
    answer = _str(rec, answer, "answer")
    if "####" in answer:  # a GSM8K-style worked answer
        solution, answer = answer, tasks.gsm8k_final_answer(answer)
    return _base(rec, ctx, "math", question, answer.strip(), solution=solution if isinstance(solution, str) else None)


@dataclass
class Layout:
    name: str
    matches: Callable[[set], bool]
    parse: Callable[[Record, Context], dict]


LAYOUTS: dict[str, Layout] = {}


def register_layout(name: str, matches: Callable[[set], bool], parse: Callable[[Record, Context], dict]) -> None:
    LAYOUTS[name] = Layout(name, matches, parse)


# Detection order matters: the most specific column sets first.
register_layout("dare", lambda k: {"prompt", "reward_model"} <= k, parse_dare)
register_layout("humaneval", lambda k: {"prompt", "test", "entry_point"} <= k, parse_humaneval)
register_layout("mbpp", lambda k: "test_list" in k and bool({"text", "prompt"} & k), parse_mbpp)
register_layout("countdown", lambda k: {"input", "output"} <= k or {"nums", "target"} <= k, parse_countdown)
register_layout("sudoku", lambda k: {"Puzzle", "Solution"} <= k or {"puzzle", "solution"} <= k, parse_sudoku)
register_layout("gsm8k", lambda k: {"question", "answer"} <= k and not ({"problem"} & k), parse_gsm8k)
register_layout("qa", lambda k: bool({"problem", "question", "Problem", "Question"} & k), parse_qa)


def detect_layout(first: Record) -> Layout:
    keys = set(first.data)
    if keys >= {"question", "answer"} and "####" not in str(first.data.get("answer")):
        return LAYOUTS["qa"]  # question/answer without a worked GSM8K answer (AIME-style)
    for layout in LAYOUTS.values():
        if layout.matches(keys):
            return layout
    raise DataError(f"{first.loc}: cannot tell the data layout from the columns {sorted(keys)}; "
                    f"set format: to one of {', '.join(LAYOUTS)}")


def get_layout(name: str) -> Layout:
    if name not in LAYOUTS:
        raise DataError(f"unknown data format {name!r}; known: auto, {', '.join(LAYOUTS)}")
    return LAYOUTS[name]
