"""One loader for a model named by a spec string: ``tiny:<family>``, a checkpoint folder or a Hugging Face hub id.

The trainer (``model.path``), evaluation (``dare eval --model``, the lm-eval / OpenCompass plugins, the quickstart)
and ``dare generate`` all load through ``load_model_spec``, so every entry point makes the same checks: a tokenizer
that fits the model's vocabulary and has an EOS token, a mask token id from the config, the tokenizer files next to
the checkpoint or the loaded tokenizer (configs such as LLaDA2's and SDAR-MoE's carry none), a device that exists.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from .loading import load_model, parse_dtype
from .tiny_model import tiny
from .tokenizer import load_tokenizer, tiny_tokenizer

log = logging.getLogger(__name__)

TINY_PREFIX = "tiny:"
# ``tokenizer="tiny"``: the character tokenizer (test checkpoints such as tests/assets/fixtures/* ship none).
TINY_TOKENIZER = "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def is_tiny(spec: str) -> bool:
    """Whether ``spec`` names a random tiny model (``tiny:<family>``)."""
    return str(spec).startswith(TINY_PREFIX)


def tiny_family(spec: str) -> str:
    """The family of a ``tiny:<family>`` spec."""
    return str(spec)[len(TINY_PREFIX):]


def resolve_device(device: Union[None, str, torch.device]) -> torch.device:
    """``torch.device`` for a ``--device`` value (None: cuda when available); one-line errors for a device this
    machine lacks or a name torch does not know."""
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


def _has_tokenizer_files(path: str) -> bool:
    folder = Path(path)
    return folder.is_dir() and any((folder / f).exists() for f in TOKENIZER_FILES)


def _check_tokenizer(tok, model: nn.Module, where: str) -> None:
    if len(tok) > model.arch.vocab_size:
        raise ValueError(f"the tokenizer of {where} has {len(tok)} tokens but the model's vocabulary is "
                         f"{model.arch.vocab_size}")
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {where} has no EOS token; training answers and decoding stops need one")


def foreign_tokenizer(model, tok, tokenizer_name, model_name) -> Optional[str]:
    """One line when ``tok`` has fewer tokens than the model's vocabulary *and* other special ids than the model's
    adapter (EOS, mask, pad): the signature of another model's tokenizer. Training then runs and generation returns
    empty completions (the model stops at ids this tokenizer does not use), without an error. None otherwise (a
    vocabulary padded beyond the tokenizer, as most published models have, is normal)."""
    vocab, adapter = model.arch.vocab_size, model.adapter
    if len(tok) >= vocab:
        return None
    differ = []
    eos, mask, pad = tok.eos_token_id, getattr(tok, "mask_token_id", None), tok.pad_token_id
    if eos is not None and eos not in adapter.all_stop_ids:
        differ.append(f"EOS {eos} vs {adapter.eos_token_id}")
    if mask is not None and mask != adapter.mask_token_id:
        differ.append(f"mask {mask} vs {adapter.mask_token_id}")
    if pad is not None and adapter.pad_token_id is not None and pad != adapter.pad_token_id:
        differ.append(f"pad {pad} vs {adapter.pad_token_id}")
    if not differ:
        return None
    return (f"the tokenizer {tokenizer_name} ({len(tok)} tokens) is smaller than the model {model_name} ({vocab} ids) "
            f"and has other special ids ({', '.join(differ)}; tokenizer vs model): it looks like another model's "
            f"tokenizer, and generations may come back empty; give the model's own tokenizer")


def warn_if_foreign_tokenizer(model, tok, tokenizer_name, model_name) -> None:
    problem = foreign_tokenizer(model, tok, tokenizer_name, model_name)
    if problem:
        log.warning(problem)


def load_model_spec(spec: str, *, dtype=None, device: Union[None, str, torch.device] = None, attn_backend: str = "auto",
                    mask_token_id: Optional[int] = None, tokenizer: Optional[str] = None,
                    tokenizer_required: bool = True, tiny_seed: int = 0,
                    tiny_sizes: Optional[dict] = None) -> tuple[nn.Module, Optional[object]]:
    """(model in eval mode, tokenizer) for a model spec.

    Args:
        spec: ``tiny:<family>`` (a random tiny model of that family with the character tokenizer), a checkpoint
            folder, or a Hugging Face hub id.
        dtype: ``torch.dtype`` or its name; None / "auto": the checkpoint's (tiny models: float32).
        device: where the model goes (``resolve_device`` checks it exists); None leaves it on the CPU, where it
            loads (the trainer places it itself).
        attn_backend: ``auto`` | ``sdpa`` | ``flex`` | ``flash_attn``.
        mask_token_id: overrides the checkpoint's mask token id (checkpoints only).
        tokenizer: a tokenizer folder / hub id (default: the model's), or ``"tiny"`` for the character tokenizer.
        tokenizer_required: False loads a checkpoint's tokenizer only when ``tokenizer`` is given or the folder holds
            tokenizer files (``dare generate --prompt-ids`` needs none); the returned tokenizer may then be None.
        tiny_seed: the initialisation seed of a tiny model.
        tiny_sizes: size overrides of a tiny model (``dare.models.tiny``); ignored, with a warning, for a checkpoint.
    Returns:
        ``(model, tokenizer)``: the model in eval mode (a trainer switches it to train mode itself) with
        ``name_or_path = spec``; the tokenizer's length fits the model's vocabulary and it has an EOS token.
    """
    spec = str(spec)
    dev = resolve_device(device) if device is not None else None  # before loading: a missing device fails fast
    if is_tiny(spec):
        tok = tiny_tokenizer()
        model = tiny(tiny_family(spec), tokenizer=tok, seed=tiny_seed, dtype=parse_dtype(dtype) or torch.float32,
                     **(tiny_sizes or {}))
        model.set_attn_backend(attn_backend)
        model.name_or_path = spec
    else:
        if tiny_sizes:  # a tiny recipe pointed at a real checkpoint (its comment says to swap model.path)
            import logging
            logging.getLogger(__name__).warning(
                "model.tiny_sizes %s ignored: it sizes tiny:<family> models, and %s is a checkpoint with its own sizes",
                dict(tiny_sizes), spec)
        tok_path = tokenizer or spec
        tok = None
        if tokenizer == TINY_TOKENIZER:
            tok = tiny_tokenizer()
        elif tokenizer_required or tokenizer or _has_tokenizer_files(tok_path):
            tok = load_tokenizer(tok_path)
        fallback = getattr(tok, "mask_token_id", None) if tok is not None else None
        model = load_model(spec, dtype=dtype, attn_backend=attn_backend, mask_token_id=mask_token_id,
                           fallback_mask_token_id=fallback)
        if tok is not None:
            _check_tokenizer(tok, model, tokenizer or spec)
            warn_if_foreign_tokenizer(model, tok, tokenizer or spec, spec)
    if dev is not None:
        model = model.to(dev)
    return model.eval(), tok
