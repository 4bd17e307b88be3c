"""How a checkpoint decodes and prompts, stored with it in ``dare_decoding.json``.

A dLLM checkpoint trained on one task decodes well only with the settings it was trained and evaluated with (the
shipped lazy-Sudoku LLaDA scores 41.0 at 40 tokens in one block with the compact template, 0.0 at ``dare eval``'s
defaults of 256 tokens in blocks of 32 and the reasoning prompt). Hugging Face keeps decoding defaults in
``generation_config.json``, but that file belongs to the family's own generation class, and some refuse keys they do
not know (transformers' DiffusionGemma refuses ``temperature``, ``do_sample`` and any other key). So dare's settings
go in a file of their own beside it::

    {"sampler": {"gen_length": 40, "block_length": 40, "steps": 40, "temperature": 0.0},
     "template": "compact", "chat_template": "auto"}

``dare eval``, ``dare generate`` and the lm-eval plugin read it (``read_decoding``) and use each setting a flag or
recipe does not give; the exporting trainer writes it (``write_decoding``) from the recipe's eval section, else
its rollout sampler and data template.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..files import write_text

FILE = "dare_decoding.json"
PROMPT_KEYS = ("template", "chat_template", "system_prompt", "generation_prefix")


def read_decoding(spec, sampler_fields: Optional[set] = None) -> Optional[tuple[dict, Path]]:
    """``({"sampler": {...}, "template": ..., ...}, path)`` from a checkpoint folder's dare_decoding.json, or None (no
    folder or no file). A file that is not a JSON object of that shape, or (given ``sampler_fields``, the
    ``SamplerConfig`` field names) names a sampler field that does not exist, is a ``ValueError`` naming it."""
    if spec is None or str(spec).startswith("tiny:"):
        return None
    path = Path(str(spec)).expanduser() / FILE
    if not path.is_file():
        return None
    try:
        block = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(block, dict) or not isinstance(block.get("sampler", {}), dict):
        raise ValueError(f"{path}: expected an object with a 'sampler' object and prompt fields ({', '.join(PROMPT_KEYS)})")
    unknown = sorted(set(block.get("sampler", {})) - sampler_fields) if sampler_fields is not None else []
    if unknown:
        raise ValueError(f"{path}: unknown sampler field(s) {', '.join(unknown)}")
    return block, path


def write_decoding(folder, sampler: Optional[dict], prompt: Optional[dict] = None) -> Optional[Path]:
    """Write ``folder``'s dare_decoding.json (``dare.files.write_text``: beside, then renamed over it). Nothing is
    written when there is nothing to say."""
    block = {}
    if sampler:
        block["sampler"] = {k: v for k, v in sampler.items() if v is not None}
    block.update({k: v for k, v in (prompt or {}).items() if k in PROMPT_KEYS and v is not None})
    if not block:
        return None
    path = Path(folder) / FILE
    write_text(path, json.dumps(block, indent=2, sort_keys=True) + "\n")
    return path


def sampler_defaults(own: dict, given: dict) -> dict:
    """The checkpoint's sampler fields (``own``) to use where ``given`` (flags, --set, a recipe) sets none: all of
    them, except what a length given by hand invalidates: the checkpoint's step schedule when ``gen_length`` or
    ``block_length`` is given, and its block when it does not divide the length. Taking ``gen_length`` without a
    schedule decodes one token per step (as ``dare eval --gen-length`` does)."""
    take = {k: v for k, v in own.items() if k not in given}
    if {"gen_length", "block_length"} & set(given):
        take.pop("steps", None)
        take.pop("steps_per_block", None)
    length, block = given.get("gen_length", take.get("gen_length")), take.get("block_length")
    if block is not None and length is not None and (block > length or length % block):
        take.pop("block_length")
    if "gen_length" in take and not {"steps", "steps_per_block"} & (set(given) | set(take)):
        take["steps"] = take["gen_length"]
    return take


def sampler_fields(sampler) -> dict:
    """A ``SamplerConfig``'s decoding settings that differ from the defaults (what to record for a training method,
    ``record_*``, is not how the checkpoint decodes)."""
    import dataclasses
    default = type(sampler)()
    core = ("gen_length", "block_length", "steps", "temperature")  # always said: the settings a reader looks for
    return {f.name: getattr(sampler, f.name) for f in dataclasses.fields(sampler)
            if not f.name.startswith("record_")
            and (f.name in core or getattr(sampler, f.name) != getattr(default, f.name))}


def recipe_decoding(recipe) -> tuple[Optional[dict], dict]:
    """(sampler fields, prompt fields) a trained checkpoint should carry: the recipe's eval settings when it has an
    eval section with benchmarks, else its rollout sampler (RL); the prompt: the eval template, else the data's."""
    ev, data = getattr(recipe, "eval", None), getattr(recipe, "data", None)
    dataset = getattr(data, "dataset", None)
    prompt = {"template": getattr(dataset, "template", None),
              "chat_template": getattr(dataset, "chat_template", None) or getattr(data, "chat_template", None),
              "generation_prefix": getattr(dataset, "generation_prefix", None)}
    if ev is not None and getattr(ev, "benchmarks", None):
        return sampler_fields(ev.sampler), {**prompt, "template": ev.template}
    rollout = getattr(recipe, "rollout", None)
    sampler = getattr(rollout, "sampler", None)
    return (sampler_fields(sampler) if sampler is not None else None), prompt
