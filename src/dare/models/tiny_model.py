"""``dare.models.tiny(family, **overrides)``: a random tiny model of any family, in its real config layout.

The config is the family's published config.json with the sizes shrunk, so ``save_pretrained`` +
``load_model`` round-trips through exactly the code path real checkpoints take.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from .experts import GroupedExperts
from .families import get_family
from .builder import build_model

FAMILY_ALIASES = {"lladamoe": "llada_moe", "llada-moe": "llada_moe", "llada2": "llada2_moe", "sdarmoe": "sdar_moe",
                  "sdar-moe": "sdar_moe", "llada2.1": "llada2_moe", "llada21": "llada2_moe",
                  "diffusiongemma": "diffusion_gemma", "diffusion-gemma": "diffusion_gemma", "gemma": "diffusion_gemma"}


def canonical_family(name: str) -> str:
    return FAMILY_ALIASES.get(name.lower(), name.lower())


def tiny_config(family: str, tokenizer=None, **overrides) -> tuple[dict, int]:
    """(config dict in the family's real layout, mask token id)."""
    fam = get_family(canonical_family(family))
    top = fam.tiny_config()
    cfg = fam.config_section(top)  # sizes and token ids live here (a nested text_config for multimodal layouts)
    mask_id = cfg.get("mask_token_id", 500) if fam.uses_mask_token else -1
    if tokenizer is not None:
        mask_id = tokenizer.mask_token_id if fam.uses_mask_token else -1
        ids = {"mask_token_id": mask_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
        for key, value in ids.items():
            if key in cfg:  # only keys the published layout has (LLaDA2/SDAR-MoE carry no mask id)
                cfg[key] = value
        largest = max([len(tokenizer)] + [v + 1 for v in ids.values() if v is not None])
        overrides.setdefault("vocab_size", ((largest + 7) // 8) * 8)
    if "num_heads" in overrides and "num_kv_heads" not in overrides:  # keep the family's GQA ratio
        heads_key, kv_key = fam.size_keys["num_heads"][0], fam.size_keys["num_kv_heads"][0]
        if kv_key in cfg:
            overrides["num_kv_heads"] = max(1, overrides["num_heads"] * cfg[kv_key] // cfg[heads_key])
    for key, value in overrides.items():
        if key in ("mask_token_id",):
            mask_id = value
            if key in cfg:
                cfg[key] = value
            continue
        targets = fam.size_keys.get(key)
        if targets is None:
            if key not in cfg:
                raise KeyError(f"tiny({family!r}): unknown override {key!r}; use a size name ({', '.join(fam.size_keys)}) "
                               f"or a key of its config.json")
            targets = (key,)
        for t in targets:
            if t in cfg or key in ("vocab_size",):
                cfg[t] = value
    # Keep head_dim consistent when the width changes and the config carries an explicit head_dim.
    if "head_dim" in cfg and "head_dim" not in overrides and ("hidden_size" in overrides or "num_heads" in overrides):
        hidden = cfg[fam.size_keys["hidden_size"][0]]
        heads = cfg[fam.size_keys["num_heads"][0]]
        cfg["head_dim"] = hidden // heads
        if "rotary_dim" in cfg:
            cfg["rotary_dim"] = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0))
    return top, mask_id


def init_weights(model: nn.Module, std: float = 0.02, generator: Optional[torch.Generator] = None) -> None:
    # Stacked experts draw expert by expert, as their separate per-expert parameters did (same tiny models).
    stacked = {id(m.gate_up_proj): m for m in model.modules() if isinstance(m, GroupedExperts)}
    drawn = {id(m.down_proj) for m in stacked.values()}
    for name, p in model.named_parameters():
        if id(p) in stacked:
            stacked[id(p)].init_like_separate(std, generator)
            continue
        if id(p) in drawn:
            continue
        # Norm weights and multiplicative scales (Gemma's router scale / per-expert scale) start at one.
        if re.search(r"norm(_\d+)?\.weight$", name) or name.endswith("scale"):
            nn.init.ones_(p)
        elif p.dim() == 1:  # biases
            nn.init.zeros_(p)
        else:
            with torch.no_grad():
                p.normal_(0.0, std, generator=generator)


def tiny(family: str = "llada", tokenizer=None, seed: int = 0, dtype=torch.float32, std: float = 0.02, **overrides) -> nn.Module:
    """A randomly initialised tiny model of ``family`` (llada, llada_moe, dream, sdar, sdar_moe, llada2_moe,
    diffusion_gemma).

    Sizes can be overridden by generic names (``hidden_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``intermediate_size``, ``vocab_size``) or by any key of the family's config.json. Passing ``tokenizer``
    takes vocab size and special-token ids from it.
    """
    fam = get_family(canonical_family(family))
    cfg, mask_id = tiny_config(family, tokenizer, **overrides)
    model = build_model(fam, cfg, mask_id, dtype=torch.float32)
    init_weights(model, std, torch.Generator().manual_seed(seed))
    return model.to(dtype)
