"""The planned model's shapes without its weights: a config.json (shipped for the models the full-size recipes name,
or a checkpoint folder, or a hub id fetched online), built on the meta device by the family's own code."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..models.families import detect_family, get_family
from ..models.builder import build_model
from ..models.checkpoint import CheckpointError
from ..models.loading import parse_dtype, resolve_mask_token_id
from ..models.model_spec import is_tiny, tiny_family
from ..models.tiny_model import tiny_config
from ..models.tokenizer import tiny_tokenizer

CONFIG_DIR = Path(__file__).parent / "configs"


def shipped_configs() -> dict[str, dict]:
    """Hub id -> {"file": its config.json here, "mask_token_id": id where the config carries none, "kind": what the file
    is where it is not a copy of the published one (SOURCES.md)}."""
    return json.loads((CONFIG_DIR / "index.json").read_text())


def shipped_config(hub_id: str) -> Optional[dict]:
    """The shipped entry of ``hub_id`` with its "config" read (only that file: a plan depends on the config it
    read, dare/plan/provenance.py), or None."""
    entry = shipped_configs().get(hub_id)
    return None if entry is None else {"config": json.loads((CONFIG_DIR / entry["file"]).read_text()), **entry}


def _hub_config(hub_id: str) -> tuple[dict, Optional[Path]]:
    try:
        from huggingface_hub import hf_hub_download
        path = Path(hf_hub_download(hub_id, "config.json"))
    except Exception as e:  # offline, unknown repo
        raise CheckpointError(f"{hub_id!r}: no config.json shipped with dare ({', '.join(sorted(shipped_configs()))}) "
                              f"and none could be downloaded ({type(e).__name__}); pass a folder that holds its "
                              f"config.json as model.path") from e
    return json.loads(path.read_text()), path.parent


def model_config(model_cfg) -> tuple[dict, Optional[int], str]:
    """(config dict, mask token id or None, where it came from) for a recipe's ``model`` section."""
    path = model_cfg.path
    if is_tiny(path):
        cfg, mask_id = tiny_config(tiny_family(path), tiny_tokenizer(), **(model_cfg.tiny_sizes or {}))
        return cfg, mask_id, f"tiny config of {path}"
    folder = Path(path).expanduser()
    if folder.is_dir():
        cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else None
        if cfg is None:
            raise CheckpointError(f"{folder} has no config.json")
        family = detect_family(cfg)
        mask = resolve_mask_token_id(cfg, folder, family, model_cfg.mask_token_id) if family.uses_mask_token else -1
        return cfg, mask, str(folder / "config.json")
    shipped = shipped_config(path)
    if shipped is not None:
        cfg = shipped["config"]
        family = detect_family(cfg)
        explicit = model_cfg.mask_token_id if model_cfg.mask_token_id is not None else shipped.get("mask_token_id")
        mask = resolve_mask_token_id(cfg, None, family, explicit) if family.uses_mask_token else -1
        return cfg, mask, f"dare/plan/configs/{shipped['file']} ({shipped.get('kind', 'published config')} of {path})"
    cfg, folder = _hub_config(path)
    family = detect_family(cfg)
    mask = resolve_mask_token_id(cfg, folder, family, model_cfg.mask_token_id) if family.uses_mask_token else -1
    return cfg, mask, f"config.json of {path} from the hub"


def meta_model(model_cfg):
    """(model on the meta device in ``model.dtype``, config source). No weights are read."""
    cfg, mask_id, source = model_config(model_cfg)
    family = detect_family(cfg)
    model = build_model(get_family(family.name), cfg, mask_id, attn_backend=model_cfg.attn_backend, init=False)
    dtype = parse_dtype(model_cfg.dtype) or torch.float32
    model = model.to(dtype)
    model.name_or_path = model_cfg.path
    return model, source


def empty_in_place(module) -> None:
    """Every parameter and buffer of an unsharded ``module`` replaced by an empty (fake, under the simulation's mode)
    CPU tensor of its shape, a tensor shared by several modules (tied weights) by one shared replacement. Not
    ``to_empty``: it swaps each parameter in place, and a parameter the fake mode has converted carries a weakref that
    refuses the swap (DiffusionGemma's scaled word embedding did: a one-process plan stopped there)."""
    made = {}  # id(original) -> (replacement, original): the original is kept so its id is not reused meanwhile
    for sub in module.modules():
        for table, wrap in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    made[id(t)] = (torch.nn.Parameter(empty, requires_grad=t.requires_grad) if wrap else empty, t)
                table[name] = made[id(t)][0]
