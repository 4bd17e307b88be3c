"""LoRA on any family (peft), adapter-disabled reference scoring, and merge-and-export to the family's layout.

The native modules use the familiar names (``q_proj`` ... ``down_proj``, LLaDA2's fused ``qkv_proj``), so one target
list covers every family. MoE experts are stacked weights (``dare.models.experts``) that peft cannot wrap; with
``include_experts`` they get the same per-expert adapters of the targeted ``{gate,up,down}_proj`` from dare's own
``ExpertLoRA``, which every function here handles beside peft's layers. Adapters are injected in
place (``peft.inject_adapter_in_model``): the model stays a ``DiffusionLM`` with its ``adapter`` and API, and only
the LoRA weights are trainable. A model whose modules are shared between two paths (DiffusionGemma's encoder and
decoder) re-points them after any module swap (``model.retie()``), so both modes use the same adapters. LoRA-A is re-initialised from an explicit generator so runs reproduce from their
seed without touching the global RNG.
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Iterable, Optional

import torch

from .experts import PROJECTIONS, GroupedExperts

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj")


def _adapted_layers(model: torch.nn.Module):
    """peft's layers and adapted stacked experts, in module order."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        BaseTunerLayer = ()
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, BaseTunerLayer) or (isinstance(m, GroupedExperts) and m.lora is not None)]


def has_lora(model: torch.nn.Module) -> bool:
    return bool(_adapted_layers(model))


def target_regex(targets: Iterable[str] = DEFAULT_TARGETS, include_experts: bool = True, exclude: Optional[str] = None) -> str:
    """Module-name regex of the LoRA targets; ``exclude`` (a regex) keeps matching modules out (a model's
    ``lora_exclude``: DiffusionGemma's unused vision tower)."""
    names = "|".join(sorted(set(targets)))
    prefix = "" if include_experts else r"(?!.*\.experts\.)"
    if exclude:
        prefix += rf"(?!.*(?:{exclude}))"
    return rf"^{prefix}.*\.({names})$"


def apply_lora(model: torch.nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: Iterable[str] = DEFAULT_TARGETS, include_experts: bool = True, seed: int = 0) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place; freezes everything else. Returns ``model``."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError("LoRA needs the peft package: pip install 'dare[lora]'") from e
    exclude = getattr(model, "lora_exclude", None)
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_regex(targets, include_experts, exclude))
    # Stacked experts get peft's per-expert adapters on the targeted projections from dare's own layer.
    projections = [p for p in PROJECTIONS if f"{p}_proj" in set(targets)] if include_experts else []
    experts = [m for name, m in model.named_modules() if isinstance(m, GroupedExperts)
               and not (exclude and re.search(exclude, name))] if projections else []
    for m in experts:
        m.add_lora(r, alpha, dropout, projections)
    try:
        inject_adapter_in_model(cfg, model)
    except ValueError as e:  # peft: "Target modules ... not found in the base model"
        if not experts:
            raise ValueError(f"lora.target_modules {sorted(set(targets))} matched no module of this "
                             f"{getattr(model, 'family', '')} model: {e}") from e
    _retie(model)
    gen = torch.Generator().manual_seed(seed)
    for name, layer in _adapted_layers(model):
        if isinstance(layer, GroupedExperts):
            layer.lora.init_A(gen)
            continue
        for a in layer.lora_A.values():
            with torch.no_grad():  # peft's default init, from an explicit generator
                w = torch.empty(a.weight.shape, dtype=torch.float32)
                torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=gen)
                a.weight.copy_(w.to(a.weight.dtype))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    for _, layer in _adapted_layers(model):
        if _adapter_costs_more_than_its_weight(layer):
            layer.__class__ = _merged_class(type(layer))
    return model


def _adapter_costs_more_than_its_weight(layer) -> bool:
    """Whether an adapted ``nn.Linear`` trains faster through its merged weight ``W + s B A`` (``_MergedLoRALinear``).

    Per token, peft's two extra GEMMs cost ``r (in + out)`` multiply-adds forward and about twice that backward; the
    merged weight costs one ``in x out`` GEMM more backward (the gradient of ``W + s B A``) and ``r in out`` per call,
    independent of the tokens. So it is faster when ``in out < 3 r (in + out)``: small layers with a large rank (the
    embedded task's 128-wide model with the papers' r = 128), never an 8B model's (4096-wide, r 128: 16.8M vs 3.1M).
    Only plain LoRA (no dropout, no DoRA or other variant, one adapter) qualifies."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    if not isinstance(layer, LoraLinear) or len(layer.lora_A) != 1 or layer.fan_in_fan_out or layer.lora_variant:
        return False
    name = next(iter(layer.lora_A))
    if not isinstance(layer.lora_dropout[name], torch.nn.Identity):
        return False
    base = layer.get_base_layer()
    if not isinstance(base, torch.nn.Linear):
        return False
    i, o, r = base.in_features, base.out_features, layer.r[name]
    return i * o < 3 * r * (i + o)


_MERGED_CLASSES: dict = {}


def _merged_class(cls: type) -> type:
    """``cls`` (peft's LoRA ``Linear``) with the merged-weight forward."""
    if cls not in _MERGED_CLASSES:
        _MERGED_CLASSES[cls] = type(f"Merged{cls.__name__}", (_MergedLoRAForward, cls), {})
    return _MERGED_CLASSES[cls]


class _MergedLoRAForward:
    """``y = x (W + s B A)^T + b``: the same function as peft's ``W x + s B (A x)`` (rounding apart), one GEMM over the
    tokens instead of three. Everything else (disabled adapters, merged weights, peft's extra arguments) is peft's."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or self.disable_adapters or self.merged:
            return super().forward(x, *args, **kwargs)
        name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
        if name not in self.lora_A:
            return super().forward(x, *args, **kwargs)
        base = self.get_base_layer()
        a, b = self.lora_A[name].weight, self.lora_B[name].weight
        weight = base.weight + (b @ a).to(base.weight.dtype) * self.scaling[name]
        return torch.nn.functional.linear(x, weight, base.bias)


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run the base model (adapters bypassed): the reference policy of LoRA training, without a second copy.

    Flips peft's per-layer ``_disable_adapters`` flag directly: ``enable_adapters(False)`` would also change the
    adapters' ``requires_grad``, which must not happen to parameters an optimizer (and FSDP) already hold.
    """
    layers = [m for _, m in _adapted_layers(model)]
    before = [m._disable_adapters for m in layers]
    try:
        for m in layers:
            m._disable_adapters = True
        yield model
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """Fold every adapter into its base weight and put the plain ``nn.Linear`` back (in place)."""
    for name, layer in _adapted_layers(model):
        if isinstance(layer, GroupedExperts):
            layer.merge_lora()
            continue
        layer.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    _retie(model)
    return model


def _retie(model: torch.nn.Module) -> None:
    """peft swaps a shared module under the first name it is listed by; point the other paths at the new one."""
    retie = getattr(model, "retie", None)
    if retie is not None:
        retie()
