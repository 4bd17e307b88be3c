"""Prompt templates: how an example becomes a prompt (and, for SFT, a gold completion).

A template builds a ``Prompt`` (chat messages + the text the assistant turn starts with + a plain-text
rendering for models without a chat template) per task, and a gold completion in the answer format the
template asks for. Templates are registered by name; recipes pick one with ``data.template``:

* ``reasoning`` d1's conventions: the task instruction and the ``<reasoning>...</reasoning><answer>...</answer>``
  format in the user turn (math answers as ``\\boxed{}`` inside ``<answer>``), for chat/instruct models.
* ``dare``      DARE's preprocessed parquet prompts, reproduced exactly from the structured fields (math: the
  bare question; MBPP: its 3-shot chat ending in ``[BEGIN]``; HumanEval: "Complete the following python code").
* ``plain``     base models: no chat template; math as ``Question:/Answer:``, HumanEval as a code prefix to continue.
* ``compact``   the tiny character-level tokenizer of the CPU quickstart: the puzzle digits in, ``<answer>`` + the
  16 digits + ``</answer>`` out (countdown: ``30,100,93->23`` in, ``<answer>100-93+30</answer>`` out). Tiny models
  learn short formats.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional

from . import tasks
from .schema import DataError, shown

REASONING_FORMAT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
MATH_INSTRUCTION = ("You are a math expert. You will be given a question to solve. Solve it step by step. Wrap the final "
                    "answer in a \\boxed{}. \nRespond in the following format:\n<reasoning>\nYour reasoning here\n"
                    "</reasoning>\n<answer>\n\\boxed{...}\n</answer>")
COUNTDOWN_ANSWER_RULES = ("After reasoning, provide only your final expression inside <answer></answer> tags without "
                          "including an equals sign or the target number. For example, if the numbers are [2, 3, 4] and "
                          "the target is 5, a valid answer is: <answer>\n2*4-3\n</answer>")
SUDOKU_INSTRUCTION = (
    "Please solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading "
    "left-to-right, top-to-bottom, where '0' represents empty cells.\n\nRules:\n- Fill empty cells with digits 1-4\n"
    "- Each row must contain digits 1-4 exactly once\n- Each column must contain digits 1-4 exactly once\n"
    "- Each 2x2 box must contain digits 1-4 exactly once\n\nImportant: Your solution must be a COMPLETE 16-character "
    "string with only the digits 1-4, representing your final solved grid.\n\nRespond in this exact format:\n"
    "<reasoning>\nYour step-by-step solving process\n</reasoning>\n<answer>\n"
    "[16-character solution string with no spaces or separators]\n</answer>\n")
CODE_INSTRUCTION = ("You are an expert Python programmer. Write a complete, self-contained Python solution. "
                    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n```python\n...\n```\n</answer>")
HUMANEVAL_HEADER = "Complete the following python code:\n"
MBPP_HEADER = "You are an expert Python programmer, and here is your task: "
# The three MBPP prompting examples (tasks 2-4 of the original MBPP paper) exactly as DARE's mbpp parquet ships them.
MBPP_FEWSHOT = [
    ("Write a function to find the similar elements from the given two tuple lists. Your code should pass these tests:\n\n"
     " assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)\nassert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) "
     "== (3, 4) \nassert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14) \n",
     "def similar_elements(test_tup1, test_tup2):\r\n  res = tuple(set(test_tup1) & set(test_tup2))\r\n  return (res)"),
    ("Write a python function to identify non-prime numbers. Your code should pass these tests:\n\n"
     " assert is_not_prime(2) == False \nassert is_not_prime(10) == True \nassert is_not_prime(35) == True \n",
     "import math\r\ndef is_not_prime(n):\r\n    result = False\r\n    for i in range(2,int(math.sqrt(n)) + 1):\r\n"
     "        if n % i == 0:\r\n            result = True\r\n    return result"),
    ("Write a function to find the largest integers from a given list of numbers using heap queue algorithm. Your code "
     "should pass these tests:\n\n assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65] \n"
     "assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],2)==[85, 75] \nassert heap_queue_largest( [25, 35, "
     "22, 85, 14, 65, 75, 22, 58],5)==[85, 75, 65, 58, 35] \n",
     "import heapq as hq\r\ndef heap_queue_largest(nums,n):\r\n  largest_nums = hq.nlargest(n, nums)\r\n  return largest_nums"),
]


def _mbpp_answer(code: str) -> str:
    return f"[BEGIN]\n '{code}' \n[DONE] \n\n "


@dataclass
class Prompt:
    messages: list[dict]  # chat messages, without the assistant turn
    generation_prefix: str = ""  # text the assistant turn starts with (appended after the generation prompt)
    plain: Optional[str] = None  # rendering for models without a chat template (default: joined message contents)

    def plain_text(self) -> str:
        if self.plain is not None:
            return self.plain + self.generation_prefix
        return "\n\n".join(m["content"] for m in self.messages) + "\n" + self.generation_prefix


# --- gold completions --------------------------------------------------------------------------------
def countdown_steps(expr: str) -> list[str]:
    """``100-93+30`` -> ``["100 - 93 = 7", "7 + 30 = 37"]`` (exact arithmetic, evaluation order)."""
    steps: list[str] = []

    def fmt(v: Fraction) -> str:
        return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"

    def ev(node) -> Fraction:
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        a, b = ev(node.left), ev(node.right)
        op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
        v = {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b}[op]()
        steps.append(f"{fmt(a)} {op} {fmt(b)} = {fmt(v)}")
        return v

    ev(ast.parse(expr, mode="eval").body)
    return steps


def _countdown_expr(ex: dict) -> str:
    gt = ex["ground_truth"]
    expr = tasks.solve_countdown(gt["numbers"], gt["target"])
    if expr is None:
        raise DataError(f"example {ex['id']}: no expression of {gt['numbers']} with + - * / reaches {gt['target']}, "
                        "so no gold completion exists")
    return expr


def _math_reasoning(ex: dict) -> str:
    sol = ex.get("solution") or ""
    return tasks.gsm8k_reasoning(sol) if "####" in sol else sol.strip()


def _code_solution(ex: dict, full: bool) -> str:
    sol = ex.get("canonical_solution")
    if not sol:
        raise DataError(f"example {ex['id']}: code example has no canonical_solution, so no gold completion exists")
    prefix = ex["ground_truth"].get("prefix", "")
    return (prefix + sol) if full else sol


SUDOKU_REASONING = "Fill every empty cell so that each row, column and 2x2 box holds the digits 1-4 exactly once."


def reasoning_completion(ex: dict, boxed: bool = True) -> str:
    task, gt = ex["task"], ex["ground_truth"]
    if task == "math":
        reasoning, answer = _math_reasoning(ex), (f"\\boxed{{{gt}}}" if boxed else gt)
    elif task == "countdown":
        expr = _countdown_expr(ex)
        reasoning, answer = "\n".join(countdown_steps(expr)), expr
    elif task == "sudoku":
        reasoning, answer = SUDOKU_REASONING, gt["solution"]
    else:
        reasoning, answer = "", "```python\n" + _code_solution(ex, full=True).strip("\n") + "\n```"
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


# --- templates ---------------------------------------------------------------------------------------
@dataclass
class Template:
    name: str
    prompts: dict[str, Callable[[dict], Prompt]]  # task -> prompt builder
    completion: Callable[[dict], str]  # gold completion (SFT)
    chat: bool = True  # use the tokenizer's chat template when it has one
    description: str = ""
    tasks: tuple = field(default=())

    def build(self, ex: dict, system_prompt: Optional[str] = None) -> Prompt:
        builder = self.prompts.get(ex["task"])
        if builder is None:
            raise DataError(f"template {self.name!r} has no prompt for task {shown(ex['task'])} (example {ex['id']})")
        prompt = builder(ex)
        if system_prompt:
            prompt = Prompt([{"role": "system", "content": system_prompt}] + prompt.messages, prompt.generation_prefix,
                            None if prompt.plain is None else f"{system_prompt}\n\n{prompt.plain}")
        return prompt

    def gold_completion(self, ex: dict, generation_prefix: str = "") -> str:
        text = self.completion(ex)
        # The prompt already ends with the generation prefix; the completion continues after it.
        return text[len(generation_prefix):] if generation_prefix and text.startswith(generation_prefix) else text


def _user(text: str, prefix: str = "", plain: Optional[str] = None) -> Prompt:
    return Prompt([{"role": "user", "content": text}], prefix, plain)


def _countdown_text(ex: dict) -> str:
    return f"{REASONING_FORMAT}\n{ex['question']} {COUNTDOWN_ANSWER_RULES}"


def _sudoku_text(ex: dict) -> str:
    return f"{SUDOKU_INSTRUCTION}\n\n{ex['question']}\n"


def _is_humaneval(ex: dict) -> bool:
    return bool(ex["ground_truth"].get("prefix"))


def _dare_code(ex: dict) -> Prompt:
    if _is_humaneval(ex):
        return _user(HUMANEVAL_HEADER + ex["ground_truth"]["prefix"])
    msgs = []
    for question, code in MBPP_FEWSHOT:
        msgs += [{"role": "user", "content": MBPP_HEADER + question}, {"role": "assistant", "content": _mbpp_answer(code)}]
    msgs.append({"role": "user", "content": MBPP_HEADER + ex["question"]})
    plain = "".join(f"{m['content']}\n" if m["role"] == "user" else m["content"] for m in msgs)
    return Prompt(msgs, "[BEGIN]\n", plain)


def _dare_completion(ex: dict) -> str:
    if ex["task"] == "code" and not _is_humaneval(ex):
        return _mbpp_answer(_code_solution(ex, full=False))
    return reasoning_completion(ex)


def _code_reasoning(ex: dict) -> Prompt:
    return _user(f"{CODE_INSTRUCTION}\n\n{ex['question']}")


def _plain_code(ex: dict) -> Prompt:
    prefix = ex["ground_truth"].get("prefix", "")
    text = prefix if prefix else f"{ex['question']}\n"
    return Prompt([{"role": "user", "content": text}], "", text)


def _plain_completion(ex: dict) -> str:
    if ex["task"] == "code":
        return _code_solution(ex, full=False)
    if ex["task"] == "math":
        reasoning = _math_reasoning(ex)
        return (reasoning + "\n" if reasoning else "") + f"The answer is \\boxed{{{ex['ground_truth']}}}."
    return reasoning_completion(ex)


def _compact_countdown(ex: dict) -> Prompt:
    gt = ex["ground_truth"]
    text = ",".join(str(n) for n in gt["numbers"]) + f"->{gt['target']}"
    return _user(text, plain=text + "\n")


def _compact_sudoku(ex: dict) -> Prompt:
    return _user(ex["ground_truth"]["puzzle"], plain=ex["ground_truth"]["puzzle"] + "\n")


def _compact_completion(ex: dict) -> str:
    task, gt = ex["task"], ex["ground_truth"]
    answer = {"countdown": lambda: _countdown_expr(ex), "sudoku": lambda: gt["solution"],
              "math": lambda: f"\\boxed{{{gt}}}", "code": lambda: _code_solution(ex, full=False)}[task]()
    return answer if task == "code" else f"<answer>{answer}</answer>"


TEMPLATES: dict[str, Template] = {}


def register_template(template: Template) -> Template:
    TEMPLATES[template.name] = template
    return template


register_template(Template(
    "reasoning",
    {"math": lambda ex: _user(f"{MATH_INSTRUCTION}\n\n{ex['question']}"),
     "countdown": lambda ex: _user(_countdown_text(ex)),
     "sudoku": lambda ex: _user(_sudoku_text(ex)),
     "code": _code_reasoning},
    reasoning_completion, description="d1 reasoning format (<reasoning>/<answer>) for instruct models"))
register_template(Template(
    "dare",
    {"math": lambda ex: _user(ex["question"]),
     "countdown": lambda ex: _user(_countdown_text(ex)),
     "sudoku": lambda ex: _user(_sudoku_text(ex)),
     "code": _dare_code},
    _dare_completion, description="DARE's preprocessed parquet prompts, exactly"))
register_template(Template(
    "plain",
    {"math": lambda ex: _user(ex["question"], plain=f"Question: {ex['question']}\nAnswer:"),
     "countdown": lambda ex: _user(_countdown_text(ex)),
     "sudoku": lambda ex: _user(_sudoku_text(ex)),
     "code": _plain_code},
    _plain_completion, chat=False, description="base models: no chat template"))
register_template(Template(
    "compact",
    {"math": lambda ex: _user(ex["question"], plain=ex["question"] + "\n"),
     "countdown": _compact_countdown,
     "sudoku": _compact_sudoku,
     "code": _plain_code},
    _compact_completion, description="short formats for the tiny character tokenizer (CPU quickstart)"))


def get_template(name) -> Template:
    if isinstance(name, Template):
        return name
    if name not in TEMPLATES:
        raise ValueError(f"unknown prompt template {name!r}; known: {', '.join(TEMPLATES)}")
    return TEMPLATES[name]
