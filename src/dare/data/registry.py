"""Datasets by short name: the bundled offline copies per split, and the Hugging Face id for online users.

Bundled files live in ``dare/assets/data`` (sources and licences in its SOURCES.md). Splits such as
``test_d1`` name a second bundled copy of the same items in the original layout (d1's JSONL/CSV).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "data"


@dataclass(frozen=True)
class HFSource:
    path: str
    config: Optional[str] = None
    split: Optional[str] = None  # the split name on the Hub, when it differs from ours
    format: str = "auto"


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    task: str
    files: dict = field(default_factory=dict)  # split -> path under ASSETS
    hf: dict = field(default_factory=dict)  # split -> HFSource
    description: str = ""
    # split -> {row: reason}: rows of a bundled file known to be unusable, dropped with a log line (not an error).
    known_bad: dict = field(default_factory=dict)
    # split -> {row: code}: test setup code a bundled file lost, restored from the original dataset and run before the
    # row's tests (without it the tests read names that only the candidate program could supply).
    restored_setup: dict = field(default_factory=dict)

    @property
    def splits(self) -> list[str]:
        return sorted(set(self.files) | set(self.hf))

    def bundled(self, split: str) -> Optional[Path]:
        rel = self.files.get(split)
        return ASSETS / rel if rel else None


DATASETS: dict[str, DatasetSpec] = {}


def register_dataset(spec: DatasetSpec) -> DatasetSpec:
    DATASETS[spec.name] = spec
    return spec


_T, _R = "dare/rl/test/", "dare/rl/train/"
register_dataset(DatasetSpec(
    "gsm8k", "math", {"train": _R + "gsm8k_1.parquet", "test": _T + "gsm8k_1.parquet"},
    {"train": HFSource("openai/gsm8k", "main", "train", "gsm8k"), "test": HFSource("openai/gsm8k", "main", "test", "gsm8k")},
    "grade-school math word problems (answer: the number after ####)"))
register_dataset(DatasetSpec(
    "math", "math", {"train": _R + "math_1.parquet", "test": _T + "math500_1.parquet"},
    {"test": HFSource("HuggingFaceH4/MATH-500", None, "test", "qa")},
    "competition math (train: 7,474 MATH problems; test: the MATH-500 subset)",
    known_bad={"train": {886: "no gold answer (None) in DARE's file", 1009: "no gold answer (None) in DARE's file",
                         5328: "empty gold answer in DARE's file", 5330: "empty gold answer in DARE's file"}}))
register_dataset(DatasetSpec(
    "math500", "math", {"test": _T + "math500_1.parquet"}, {"test": HFSource("HuggingFaceH4/MATH-500", None, "test", "qa")},
    "the 500-problem MATH test subset"))
register_dataset(DatasetSpec(
    "countdown", "countdown",
    {"train": _R + "countdown-n20000_1.parquet", "test": _T + "countdown_1.parquet", "test_d1": "d1/countdown_cd3_test.jsonl"},
    {}, "reach the target with + - * / using each of 3 numbers once"))
register_dataset(DatasetSpec(
    "sudoku", "sudoku",
    {"train": _R + "sudoku-n20000_1.parquet", "test": _T + "sudoku_1.parquet", "test_d1": "d1/4x4_test_sudoku.csv"},
    {}, "4x4 sudoku (16-character strings, 0 = empty)"))
register_dataset(DatasetSpec(
    "humaneval", "code", {"test": "human-eval/HumanEval.jsonl.gz", "test_dare": _T + "humaneval_1.parquet"},
    {"test": HFSource("openai/openai_humaneval", None, "test", "humaneval")}, "164 Python function completions"))
# MBPP task 367 (bundled mbpp/test row 356, is_tree_balanced): its test_setup_code, which DARE's parquet dropped, from
# google-research/google-research mbpp/mbpp.jsonl (CC-BY-4.0; line endings and trailing spaces normalised).
_MBPP_367_SETUP = """root = Node(1)
root.left = Node(2)
root.right = Node(3)
root.left.left = Node(4)
root.left.right = Node(5)
root.left.left.left = Node(8)
root1 = Node(1)
root1.left = Node(2)
root1.right = Node(3)
root1.left.left = Node(4)
root1.left.right = Node(5)
root1.right.left = Node(6)
root1.left.left.left = Node(7)
root2 = Node(1)
root2.left = Node(2)
root2.right = Node(3)
root2.left.left = Node(4)
root2.left.right = Node(5)
root2.left.left.left = Node(7)
"""
register_dataset(DatasetSpec(
    "mbpp", "code", {"test": _T + "mbpp_1.parquet"}, {"test": HFSource("google-research-datasets/mbpp", "full", "test", "mbpp")},
    "basic Python problems with assert tests (3-shot prompt)", restored_setup={"test": {356: _MBPP_367_SETUP}}))
register_dataset(DatasetSpec(
    "aime24", "math", {"test": _T + "aime2024_1.parquet"}, {"test": HFSource("HuggingFaceH4/aime_2024", None, "train", "qa")},
    "AIME 2024 (30 problems)"))
register_dataset(DatasetSpec("aime25", "math", {"test": _T + "aime2025_1.parquet"}, {}, "AIME 2025 (30 problems)"))
register_dataset(DatasetSpec(
    "olympiadbench", "math", {}, {"test": HFSource("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train", "qa")},
    "OlympiadBench, open-ended text-only English competition math (674; Hub only: question + final_answer)"))


def get_dataset(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; registered: {', '.join(DATASETS)} (or give data.path / data.hf)")
    return DATASETS[name]
