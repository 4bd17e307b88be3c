"""Model labels for evaluation results: a checkpoint folder / Hugging Face id, or ``tiny:<family>``.

Loading a model spec is ``dare.models.model_spec.load_model_spec`` (shared with the trainer and ``dare generate``).
"""
from __future__ import annotations

from pathlib import Path

from ..models.model_spec import is_tiny, tiny_family


def model_name(spec: str) -> str:
    """A short, file-name-safe label for results tables and output folders."""
    if is_tiny(spec):
        return "tiny-" + tiny_family(spec)
    p = Path(spec)
    name = p.name if p.name else spec
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
