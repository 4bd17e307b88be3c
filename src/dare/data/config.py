"""``DataConfig``: where examples come from and how they become prompts (a recipe's ``data:`` section)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class DataConfig:
    # Exactly one source: a registered short name (gsm8k, sudoku, ...; see ``dare.data.DATASETS``), a local file
    # (parquet / jsonl / jsonl.gz / json / csv), or a Hugging Face dataset id (needs ``pip install datasets``).
    name: Optional[str] = None
    path: Optional[str] = None
    hf: Optional[str] = None
    hf_config: Optional[str] = None  # the HF dataset's config name (e.g. "main" for openai/gsm8k)
    # Or a function of yours that returns the rows (dicts in any layout below): module:function or
    # path/to/file.py:function (relative to the working directory), called with the split name (docs/data.md, "Your own loader").
    loader: Optional[str] = None
    split: str = "train"
    # name: "auto" reads the bundled copy when there is one, else the dataset's Hugging Face id; "hf" forces the Hub.
    source: Literal["auto", "bundled", "hf"] = "auto"
    format: str = "auto"  # row layout: auto, dare, humaneval, mbpp, countdown, sudoku, gsm8k, qa
    task: Optional[str] = None  # override the task of every row (math, countdown, sudoku, code)
    limit: Optional[int] = None  # keep the first N examples (after shuffling)
    shuffle_seed: Optional[int] = None  # shuffle with this seed (None = file order)
    template: str = "reasoning"  # reasoning, dare, plain, compact (see dare.data.templates)
    system_prompt: Optional[str] = None  # prepended as a system message
    chat_template: Literal["auto", "always", "never"] = "auto"  # auto: use the tokenizer's when it has one
    generation_prefix: Optional[str] = None  # text the assistant turn starts with (e.g. "<reasoning>"); None = template's
    max_prompt_tokens: Optional[int] = None  # longer prompts are bad rows (see on_bad_row)
    on_bad_row: Literal["error", "skip"] = "error"  # skip: log each bad row (file + row) and leave it out
    # A mixture instead of one source: each entry is a source (name/path/hf with its own split, format, limit,
    # shuffle); their examples are concatenated, then this section's shuffle/limit/template apply to the whole.
    mix: list["DataConfig"] = field(default_factory=list)

    def __post_init__(self):
        given = [k for k in ("name", "path", "hf", "loader") if getattr(self, k)]
        if self.mix and given:
            raise ValueError(f"data: set either mix (a list of sources) or one of name, path, hf, loader (got mix and "
                             f"{', '.join(given)})")
        if not self.mix and len(given) != 1:
            raise ValueError(f"data: set exactly one of name, path, hf, loader or mix (got {', '.join(given) or 'none'})")
        if self.loader:
            from ..config.references import load_reference
            load_reference(self.loader, "data.loader")  # the file or module and its function exist
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"data.limit must be >= 0, got {self.limit}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError(f"data.max_prompt_tokens must be positive, got {self.max_prompt_tokens}")

    def describe(self) -> str:
        """Where the examples come from, for messages."""
        if self.mix:
            return "mix(" + ", ".join(m.describe() for m in self.mix) + ")"
        return str(self.path or self.hf or self.loader or self.name)
