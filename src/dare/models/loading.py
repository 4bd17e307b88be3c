"""Load and save checkpoints in each family's own published layout (config.json + safetensors).

No ``trust_remote_code``: config.json is read as data, the family is detected from ``model_type`` and
``architectures``, tensors are renamed to the native module tree and every one is checked for presence
and shape. ``save_pretrained`` writes the same layout back (config keys preserved, published tensor
names, sharded with an index above the shard size), so a dare checkpoint loads in the family's own code.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .experts import per_expert_names, split_expert_tensor, stack_expert_tensors
from .families import detect_family, get_family
from .families.base import Family
from .model import DiffusionLM

log = logging.getLogger(__name__)

CONFIG_FILES = ("config.json",)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "float64": torch.float64, "fp64": torch.float64}  # float64: exact-reproduction tests (docs/samplers.md)


class CheckpointError(ValueError):
    pass


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
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON: {e}") from e


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from e
        files = sorted({folder / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return shards
    raise CheckpointError(f"{folder} has no safetensors weights (model.safetensors or an index); .bin checkpoints are not supported")


def read_state_dict(folder: Path, family: Family) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its native name. A truncated or corrupted file, or a tensor holding
    NaN/inf, is an error naming the file (and tensor) instead of a traceback or a model that outputs NaN."""
    out = {}
    for f in checkpoint_files(folder):
        key = None
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    tensor = fh.get_tensor(key)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        raise CheckpointError(f"{f}: tensor {key} holds non-finite values (NaN/inf); the file is "
                                              f"corrupted or the model diverged before it was saved")
                    out[family.to_native(key)] = tensor
        except CheckpointError:
            raise
        except Exception as e:  # safetensors' own error types: a cut or damaged file
            where = f" (tensor {key})" if key is not None else ""
            raise CheckpointError(f"{f}{where}: unreadable safetensors file ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}); the file is truncated or corrupted") from e
    return out


def mask_token_from_tokenizer(folder: Path, family: Family) -> Optional[int]:
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


def resolve_mask_token_id(cfg: dict, folder: Optional[Path], family: Family, explicit: Optional[int]) -> int:
    from_config = cfg.get("mask_token_id")
    from_tok = mask_token_from_tokenizer(folder, family) if folder is not None and from_config is None else None
    found = from_config if from_config is not None else from_tok
    if explicit is not None:
        if found is not None and found != explicit:
            log.warning("mask_token_id=%s overrides %s from the checkpoint", explicit, found)
        return int(explicit)
    if found is None:
        raise CheckpointError(
            f"no mask token id: config.json has no mask_token_id and no tokenizer mask token ({', '.join(family.mask_token_strings)}) "
            f"was found next to the checkpoint; pass mask_token_id=... (e.g. 156895 for LLaDA2, 151669 for SDAR)")
    return int(found)


def build_model(family: Family, cfg: dict, mask_token_id: int, dtype=torch.float32, device=None,
                attn_backend: str = "auto", init: bool = True):
    """A model of ``family`` from a config dict; ``init=False`` builds on the meta device (for loading)."""
    return family.build(cfg, mask_token_id, dtype=dtype, device=device, attn_backend=attn_backend, init=init)


def load_state_dict_checked(model: DiffusionLM, state: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> None:
    family = get_family(model.family)
    expected = model.state_dict()
    state, wrong = stack_expert_tensors(state, expected)  # published per-expert tensors -> stacked expert parameters
    if wrong:
        k, got, want = wrong[0]
        raise CheckpointError(f"{where}: tensor {family.to_published(k)} has shape {got}, config.json implies {want}")
    missing = [k for k in expected if k not in state and not (k == "lm_head.weight" and model.arch.tie_word_embeddings)]
    # a stacked expert parameter is missing when one of its per-expert tensors is: name those
    missing = [n for k in missing for n in per_expert_names(k, expected[k].shape[0]) if n not in state]
    if missing:
        names = ", ".join(family.to_published(k) for k in missing[:8])
        raise CheckpointError(f"{where}: missing tensor(s) {names}{' ...' if len(missing) > 8 else ''} "
                              f"({len(missing)} of {len(expected)})")
    unexpected = [k for k in state if k not in expected and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        names = ", ".join(family.to_published(k) for k in unexpected[:8])
        raise CheckpointError(f"{where}: unexpected tensor(s) {names} are not part of the {model.family} architecture "
                              f"described by config.json")
    for k, t in expected.items():
        if k in state and tuple(state[k].shape) != tuple(t.shape):
            raise CheckpointError(f"{where}: tensor {family.to_published(k)} has shape {tuple(state[k].shape)}, "
                                  f"config.json implies {tuple(t.shape)}")
    converted = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items() if k in expected}
    if model.arch.tie_word_embeddings:
        converted.pop("lm_head.weight", None)
    model.load_state_dict(converted, strict=False, assign=True)
    if model.arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def load_model(path_or_id, dtype=None, device=None, attn_backend: str = "auto", mask_token_id: Optional[int] = None) -> DiffusionLM:
    """Load any supported dLLM from its published layout. ``dtype=None`` keeps the checkpoint's dtype."""
    folder = resolve_path(path_or_id)
    cfg = read_config(folder)
    family = detect_family(cfg)
    mask_id = resolve_mask_token_id(cfg, folder, family, mask_token_id) if family.uses_mask_token else -1
    dtype = parse_dtype(dtype) or parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    model = family.load(folder, cfg, mask_id, dtype, attn_backend)
    model.name_or_path = str(path_or_id)
    model.eval()
    return model.to(device) if device is not None else model


def save_pretrained(model: DiffusionLM, path, tokenizer=None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json + safetensors with the family's published tensor names (sharded above ``max_shard_bytes``)."""
    family = get_family(model.family)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue
        if hasattr(v, "full_tensor"):  # FSDP2 DTensor
            v = v.full_tensor()
        for name, part in split_expert_tensor(k, v.detach().to("cpu")):  # stacked experts: one tensor per expert
            part = part.contiguous()
            if part.untyped_storage().nbytes() != part.numel() * part.element_size():  # a view of a buffer: own storage
                part = part.clone()
            state[family.to_published(name)] = part
    cfg = dict(model.hf_config)
    dtype_name = str(model.dtype).replace("torch.", "")
    for key in ("torch_dtype", "dtype"):
        if key in cfg:
            cfg[key] = dtype_name
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shards, current, size = [], {}, 0
    for k in sorted(state):
        nbytes = state[k].numel() * state[k].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k] = state[k]
        size += nbytes
    shards.append(current)
    for old in list(out.glob("model*.safetensors")) + list(out.glob("model.safetensors.index.json")):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
