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


def resolve_device(device: Optional[str]):
    """``torch.device`` for a ``--device`` value (None: cuda when available); one-line errors for a device this
    machine lacks or a name torch does not know."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r}: not a device name (use cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available here (torch {torch.__version__}, "
                             f"{'no GPU visible' if torch.backends.cuda.is_built() else 'built without CUDA'}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu" and dev.type != "meta":
        backend = getattr(torch.backends, dev.type, None)
        if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
            raise ValueError(f"--device {device}: {dev.type} is not available here; use --device cpu")
    return dev


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

    device = resolve_device(device)
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
        from ..trainer.model_setup import warn_if_foreign_tokenizer
        warn_if_foreign_tokenizer(model, tok, tokenizer or spec, spec)
    return model.to(device).eval(), tok
