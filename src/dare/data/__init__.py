"""Datasets, normalised examples and prompt templates (see docs/data.md).

    from dare.data import DataConfig, load_examples, build_prompts, build_sft_example
    examples = load_examples(DataConfig(name="sudoku", split="train", limit=100))
    prompt_text, completion = build_sft_example(examples[0], "compact", tokenizer)
"""
from .config import DataConfig
from .layouts import LAYOUTS, register_layout
from .loading import iter_examples, load_examples
from .prompts import (PromptedExample, build_prompts, build_sft_example, encode_prompt, render, render_prompt,
                      uses_chat_template)
from .registry import ASSETS, DATASETS, DatasetSpec, HFSource, get_dataset, register_dataset
from .schema import TASKS, BadRowPolicy, DataError, validate_example
from .tasks import solve_countdown
from .templates import TEMPLATES, Prompt, Template, get_template, register_template

__all__ = [
    "DataConfig", "LAYOUTS", "register_layout", "iter_examples", "load_examples", "PromptedExample", "build_prompts",
    "build_sft_example", "encode_prompt", "render", "render_prompt", "uses_chat_template", "ASSETS", "DATASETS",
    "DatasetSpec", "HFSource",
    "get_dataset", "register_dataset", "TASKS", "BadRowPolicy", "DataError", "validate_example", "solve_countdown",
    "TEMPLATES", "Prompt", "Template", "get_template", "register_template",
]
