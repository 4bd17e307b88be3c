"""Model specs for evaluation: a checkpoint folder / Hugging Face id, or ``tiny:<family>`` (random tiny model)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

TINY_PREFIX = "tiny:"


def model_name(spec: str) -> str:
    """A short, file-name-safe label for results tables and output folders."""
    if spec.startswith(TINY_PREFIX):
        return "tiny-" + spec[len(TINY_PREFIX):]
    p = Path(spec)
    name = p.name if p.name else spec
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def load_for_eval(spec: str, *, dtype: Optional[str] = None, device: Optional[str] = None,
                  mask_token_id: Optional[int] = None, tokenizer: Optional[str] = None, tiny_seed: int = 0):
    """(model in eval mode, tokenizer) for ``spec``.

    ``tiny:<family>`` builds a randomly initialised tiny model of that family with the character-level tiny
    tokenizer (seeded by ``tiny_seed``): the CPU pipeline check. Anything else goes through
    ``dare.models.load_model`` and ``load_tokenizer`` (the tokenizer from ``tokenizer`` or the model folder).
    """
    import torch

    from ..models import load_model, tiny
    from ..models.tokenizer import load_tokenizer, tiny_tokenizer

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith(TINY_PREFIX):
        tok = tiny_tokenizer()
        model = tiny(spec[len(TINY_PREFIX):], tokenizer=tok, seed=tiny_seed)
        if dtype is not None:
            from ..models import parse_dtype
            model = model.to(parse_dtype(dtype))
    else:
        tok = load_tokenizer(tokenizer or spec)
        if mask_token_id is None and getattr(tok, "mask_token_id", None) is not None:
            try:
                model = load_model(spec, dtype=dtype)
            except ValueError:  # the config carries no mask id (LLaDA2, SDAR-MoE): take the tokenizer's
                model = load_model(spec, dtype=dtype, mask_token_id=tok.mask_token_id)
        else:
            model = load_model(spec, dtype=dtype, mask_token_id=mask_token_id)
    return model.to(device).eval(), tok
