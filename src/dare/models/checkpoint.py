"""Weights in each family's published layout: safetensors read (every tensor checked) and written back.

``read_state_dict`` renames the published tensors to the native module tree (the family spec's ``key_rules``),
``load_state_dict_checked`` puts them into a built skeleton with every tensor checked for presence and shape,
``save_pretrained`` writes config.json + safetensors with the published names (sharded with an index above the shard
size), so a dare checkpoint loads in the family's own code. The model code calls ``save_pretrained``; this module
imports no model code (only the family specs and the expert stacking).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .experts import per_expert_names, split_expert_tensor, stack_expert_tensors
from .families import FamilySpec, get_family


class CheckpointError(ValueError):
    pass


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


def read_state_dict(folder: Path, family: FamilySpec) -> dict[str, torch.Tensor]:
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


def load_state_dict_checked(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype, where: str) -> None:
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


def save_pretrained(model: nn.Module, path, tokenizer=None, max_shard_bytes: int = 5 * 2**30) -> None:
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
