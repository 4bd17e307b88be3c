"""Models from family specs: the one place that turns (spec, config.json) into a module, with or without weights.

A family spec (``dare.models.families``) says what the family is; its ``builder`` field names the entry of
``BUILDERS`` that makes the model: ``"native"`` builds dare's ``DiffusionLM`` from the spec's ``arch`` and
``adapter`` and fills it from the checkpoint's safetensors; ``"diffusion_gemma"`` wraps transformers' own
``DiffusionGemmaForBlockDiffusion`` (``dare.models.diffusion_gemma``). This module imports the model code and the
specs; neither imports it back.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .checkpoint import load_state_dict_checked, read_state_dict
from .diffusion_gemma import build_diffusion_gemma, load_diffusion_gemma
from .families import FamilySpec, UnsupportedModelError
from .model import DiffusionLM


@dataclass(frozen=True)
class Builder:
    # (spec, cfg, mask_token_id, dtype, device, attn_backend, init) -> model; ``init=False``: parameters on the meta
    # device (a skeleton for loading, or a shape-only model for ``dare plan``).
    build: Callable[..., nn.Module]
    # (spec, folder, cfg, mask_token_id, dtype, attn_backend) -> model holding the checkpoint's weights, every tensor
    # checked (a missing, unexpected or misshapen one is a ``CheckpointError`` naming it).
    load: Callable[..., nn.Module]


def build_native(spec: FamilySpec, cfg: dict, mask_token_id: int, dtype=None, device=None, attn_backend: str = "auto",
                 init: bool = True) -> DiffusionLM:
    """dare's ``DiffusionLM`` of ``spec``'s architecture read from ``cfg`` (random init, or on the meta device)."""
    arch, adapter = spec.read_arch(cfg), spec.adapter(cfg, mask_token_id)
    if init:
        return DiffusionLM(arch, adapter, cfg, spec.name, attn_backend).to(dtype=dtype, device=device).fuse_projections()
    with torch.device("meta"):
        return DiffusionLM(arch, adapter, cfg, spec.name, attn_backend)


def load_native(spec: FamilySpec, folder: Path, cfg: dict, mask_token_id: int, dtype: torch.dtype,
                attn_backend: str = "auto") -> DiffusionLM:
    """The checkpoint in ``folder`` (its config already parsed into ``cfg``) in a meta skeleton, every tensor checked."""
    model = build_native(spec, cfg, mask_token_id, attn_backend=attn_backend, init=False)
    load_state_dict_checked(model, read_state_dict(folder, spec), dtype, str(folder))
    return model.fuse_projections()  # after loading: assign-loading gave every weight its own storage


BUILDERS: dict[str, Builder] = {
    "native": Builder(build_native, load_native),
    "diffusion_gemma": Builder(build_diffusion_gemma, load_diffusion_gemma),
}


def builder_of(spec: FamilySpec) -> Builder:
    if spec.builder not in BUILDERS:
        raise UnsupportedModelError(f"{spec.name}: builder {spec.builder!r} is not one of {', '.join(BUILDERS)}")
    return BUILDERS[spec.builder]


def build_model(spec: FamilySpec, cfg: dict, mask_token_id: int, dtype=torch.float32, device=None,
                attn_backend: str = "auto", init: bool = True) -> nn.Module:
    """A model of ``spec`` from a config dict, without weights.

    Args:
        spec: the family (``dare.models.get_family(name)`` / ``detect_family(cfg)``).
        cfg: its config.json as a dict (the published layout; kept as ``model.hf_config``).
        mask_token_id: the mask token id (-1 for families without one).
        dtype, device: where random parameters live (``init=True`` only).
        attn_backend: ``auto`` | ``sdpa`` | ``flex`` | ``flash_attn`` (native models).
        init: False builds the parameters on the meta device (for loading, or shapes only).
    """
    return builder_of(spec).build(spec, cfg, mask_token_id, dtype=dtype, device=device, attn_backend=attn_backend,
                                  init=init)


def load_weights(spec: FamilySpec, folder: Path, cfg: dict, mask_token_id: int, dtype: torch.dtype,
                 attn_backend: str = "auto") -> nn.Module:
    """The model of ``spec`` holding the checkpoint in ``folder``, every tensor checked.

    Args:
        spec: the family (``detect_family(cfg)``).
        folder: the checkpoint folder (config.json + safetensors).
        cfg: its config.json, already parsed.
        mask_token_id: the resolved mask token id (-1 for families without one).
        dtype: the parameters' dtype.
        attn_backend: ``auto`` | ``sdpa`` | ``flex`` | ``flash_attn`` (native models).
    """
    return builder_of(spec).load(spec, folder, cfg, mask_token_id, dtype, attn_backend)
