"""``load_model``: any supported dLLM from its published layout (a local folder or a Hugging Face hub id).

No ``trust_remote_code``: config.json is read as data, the family is detected from ``model_type`` and
``architectures`` (``dare.models.families``), the mask token id is resolved (config, tokenizer files, argument) and
the family's builder (``dare.models.builder``) loads the weights, every tensor checked (``dare.models.checkpoint``).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from .builder import load_weights
from .checkpoint import CheckpointError
from .families import FamilySpec, detect_family

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json",)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "float64": torch.float64, "fp64": torch.float64}  # float64: exact-reproduction tests (docs/samplers.md)


def parse_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).replace("torch.", "")
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def resolve_path(path_or_id: Union[str, os.PathLike]) -> Path:
    """A local folder, or a Hugging Face hub id downloaded (config, tokenizer, safetensors only)."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p} is a file; pass the checkpoint folder that holds config.json")
        return p
    text = str(path_or_id)
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"checkpoint folder not found: {p}")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(text, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # offline, unknown repo, ...
        raise CheckpointError(f"{text!r} is neither a local folder nor a downloadable Hugging Face model id: {e}") from e


def read_config(folder: Path) -> dict:
    f = folder / "config.json"
    if not f.exists():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        cfg = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{f}: expected a JSON object of the model's settings, got a {type(cfg).__name__}")
    return cfg


def mask_token_from_tokenizer(folder: Path, family: FamilySpec) -> Optional[int]:
    """The mask token id from tokenizer files next to the checkpoint (several configs carry none)."""
    strings = set(family.mask_token_strings) | {"<|mask|>", "<|mdm_mask|>", "<|MASK|>", "<MASK>"}
    tc = folder / "tokenizer_config.json"
    if tc.exists():
        cfg = json.loads(tc.read_text())
        declared = cfg.get("mask_token")
        if isinstance(declared, dict):
            declared = declared.get("content")
        for tid, tok in (cfg.get("added_tokens_decoder") or {}).items():
            content = tok.get("content") if isinstance(tok, dict) else tok
            if content == declared or content in strings:
                return int(tid)
    at = folder / "added_tokens.json"
    if at.exists():
        for content, tid in json.loads(at.read_text()).items():
            if content in strings:
                return int(tid)
    tj = folder / "tokenizer.json"
    if tj.exists():
        for tok in json.loads(tj.read_text()).get("added_tokens", []):
            if tok.get("content") in strings:
                return int(tok["id"])
    return None


def resolve_mask_token_id(cfg: dict, folder: Optional[Path], family: FamilySpec, explicit: Optional[int],
                          fallback: Optional[int] = None) -> int:
    """The mask token id: ``explicit`` (overrides, with a warning when the checkpoint names another), else config.json's,
    else the mask token of the tokenizer files in ``folder``, else ``fallback`` (a separately loaded tokenizer's)."""
    from_config = cfg.get("mask_token_id")
    from_tok = mask_token_from_tokenizer(folder, family) if folder is not None and from_config is None else None
    found = from_config if from_config is not None else from_tok
    if explicit is not None:
        if found is not None and found != explicit:
            log.warning("mask_token_id=%s overrides %s from the checkpoint", explicit, found)
        return int(explicit)
    if found is None and fallback is not None:
        return int(fallback)
    if found is None:
        raise CheckpointError(
            f"no mask token id: config.json has no mask_token_id and no tokenizer mask token ({', '.join(family.mask_token_strings)}) "
            f"was found next to the checkpoint; pass mask_token_id=... (e.g. 156895 for LLaDA2, 151669 for SDAR)")
    return int(found)


def load_model(path_or_id, dtype=None, device=None, attn_backend: str = "auto", mask_token_id: Optional[int] = None,
               fallback_mask_token_id: Optional[int] = None) -> nn.Module:
    """Load any supported dLLM from its published layout, in eval mode.

    Args:
        path_or_id: a checkpoint folder (config.json + safetensors) or a Hugging Face hub id.
        dtype: ``torch.dtype`` or its name; None / "auto" keeps the checkpoint's (``torch_dtype``, else float32).
        device: where the model goes (None: CPU, where it loads).
        attn_backend: ``auto`` | ``sdpa`` | ``flex`` | ``flash_attn``.
        mask_token_id: overrides the checkpoint's mask token id.
        fallback_mask_token_id: used only when neither config.json nor the tokenizer files next to the checkpoint name
            one (a tokenizer loaded from elsewhere knows it: LLaDA2, SDAR-MoE configs carry none).
    Returns:
        ``DiffusionLM`` (or the family builder's model, e.g. ``DiffusionGemmaLM``) with ``name_or_path`` set.
    """
    folder = resolve_path(path_or_id)
    cfg = read_config(folder)
    family = detect_family(cfg)
    mask_id = (resolve_mask_token_id(cfg, folder, family, mask_token_id, fallback_mask_token_id)
               if family.uses_mask_token else -1)
    dtype = parse_dtype(dtype) or parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    model = load_weights(family, folder, cfg, mask_id, dtype, attn_backend)
    model.name_or_path = str(path_or_id)
    model.eval()
    return model.to(device) if device is not None else model
