"""The decoder layer as plain functions over a snapshot of its inference weights, for the samplers' loop.

A diffusion step on a small model is overhead-bound: at a 32-token step of a 4-layer model the module tree pays
~40 ``nn.Module`` calls and 8 checks that the fused q/k/v and gate/up buffers are still live per forward (1.02-1.16x
per decode of the rollout benchmark's model without them, benchmarks/rollout.md). While a sampler runs nothing changes the weights, so ``DiffusionLM.decoding()``
takes each dense layer's inference weights once (``snapshot_layer``) and the forward runs ``lean_layer`` instead
of the module: the same functions (``project_fused_qkv``, ``attend``, ``silu_mul``, ``rms_norm``) in the same order,
so the same bits (tests/models/test_lean.py compares every sampler mode against the module path).

A layer gets no snapshot, and runs through its modules, where the modules could do something a snapshot would
miss: a sparse-MoE MLP, LLaDA2's native fused q/k/v, fused buffers that are not live (LoRA-wrapped projections,
FSDP-sharded or re-stored weights, training forwards), or forward hooks on any of its modules (or global ones).
"""
from __future__ import annotations

import functools
import itertools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from .fused import is_plain_tensor
from .modules import MLP, AttnInputs, DecoderLayer, QuerySel, attend, pack_rows, project_fused_qkv, rms_norm, silu_mul, take_rows


class LayerWeights(NamedTuple):
    """One dense decoder layer's inference weights (fused q/k/v and gate/up buffers) and shapes."""
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_full_precision: bool
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    o_proj: torch.Tensor
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    qk_eps: float
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    down: torch.Tensor


def _hooked(mod: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in mod.modules())


def snapshot_layer(layer: DecoderLayer) -> Optional[LayerWeights]:
    """``layer``'s weights for ``lean_layer``, or None where it must run through its modules (see the module doc)."""
    attn, mlp = layer.self_attn, layer.mlp
    if type(layer) is not DecoderLayer or type(mlp) is not MLP or attn.fused or _hooked(layer):
        return None
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return None
    qkv, gate_up = attn.live_fused("_fused_qkv"), mlp.live_fused("_fused_gate_up")
    if qkv is None or gate_up is None:
        return None
    o, down = attn.o_proj, mlp.down_proj
    if type(o) is not nn.Linear or type(down) is not nn.Linear or o.bias is not None or down.bias is not None:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm) + ((attn.q_norm, attn.k_norm) if attn.qk_norm else ())
    if not all(is_plain_tensor(t) for t in (o.weight, down.weight, *(n.weight for n in norms))):
        return None
    return LayerWeights(
        layer_idx=attn.layer_idx, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        eps=layer.input_layernorm.eps, rope_full_precision=attn.rope_full_precision,
        input_norm=layer.input_layernorm.weight, qkv=qkv.weight, qkv_bias=qkv.bias, o_proj=o.weight,
        q_norm=attn.q_norm.weight if attn.qk_norm else None, k_norm=attn.k_norm.weight if attn.qk_norm else None,
        qk_eps=attn.q_norm.eps if attn.qk_norm else 0.0, post_norm=layer.post_attention_layernorm.weight,
        post_eps=layer.post_attention_layernorm.eps, gate_up=gate_up.weight, down=down.weight)


def lean_layer(p: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs,
               query_rows: Optional[QuerySel] = None, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``DecoderLayer.forward`` of the layer ``p`` was taken from, without its modules (same arguments, same bits)."""
    h = rms_norm(x, p.input_norm, p.eps)
    q, k, v, qk = project_fused_qkv(h, p.qkv, p.qkv_bias, query_rows, p.num_heads, p.num_kv_heads, p.head_dim)
    if p.q_norm is not None:
        q, k, qk = rms_norm(q, p.q_norm, p.qk_eps), rms_norm(k, p.k_norm, p.qk_eps), None
    out = attend(q, k, v, qk, cos, sin, attn, query_rows, p.layer_idx, p.rope_full_precision, p.num_heads,
                 p.num_kv_heads, p.head_dim)
    x = take_rows(x, query_rows) + F.linear(out, p.o_proj)
    if keep is not None:
        x = pack_rows(x, keep)
    return x + F.linear(silu_mul(F.linear(rms_norm(x, p.post_norm, p.post_eps), p.gate_up)), p.down)


# --- compiled cached steps (opt-in: ``SamplerConfig.compile``) --------------------------------------------------------
# A cached diffusion step has fixed shapes for a whole decode (the block, the cache window), so the layer stack compiles
# to one graph: inductor fuses each norm, RoPE and SwiGLU into one kernel and its C++ wrapper launches them without
# Python (1.12-1.21x per dual-cache decode over the lean eager path on the benchmark's model; nothing for prefix-cache
# steps, which are GEMM-bound, or for 64-row groups). Fused kernels round differently from the eager ops, so a
# compiled step is not bit for bit the eager one; it is judged by the tokens it decodes
# (tests/rollout/test_compiled_step.py).


class _SlotKV:
    """The KV writes of a compiled cached step: the step's keys/values go to slots ``index`` of per-layer buffers whose
    whole length is the attended window (``KVCache.slot_writes``); an index copy, so no shape depends on where."""

    def __init__(self, ks: list, vs: list, index: torch.Tensor):
        self.k, self.v, self.index = ks, vs, index

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[i].index_copy_(2, self.index, k)
        self.v[i].index_copy_(2, self.index, v)
        return self.k[i], self.v[i]


def _stack(layers: list, x, cos, sin, mask, ks, vs, index, keep, r0: Optional[int], r1: Optional[int]):
    attn = AttnInputs(mask=mask, cache=_SlotKV(ks, vs, index))
    rows = None if r0 is None else slice(r0, r1)
    last = len(layers) - 1
    for i, p in enumerate(layers):
        x = lean_layer(p, x, cos, sin, attn, rows if i == last else None, keep if i == last else None)
    return x


_COMPILED: dict = {}
_CODE_NAMES = itertools.count()  # never reused, even if _COMPILED is emptied


@functools.cache
def compile_problem() -> Optional[str]:
    """Why ``torch.compile`` cannot build a kernel on this machine (inductor needs a C++ compiler and the Python
    headers), or None when it can; probed once per process with a one-op function."""
    try:
        torch.compile(lambda t: t * 2 + 1, fullgraph=True, options={"cpp_wrapper": True})(torch.ones(4))
        return None
    except Exception as e:  # any failure to build: report it instead of failing mid-decode
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def stack_signature(layers: list) -> tuple:
    """What a compiled stack is specialised to: every layer's sizes and flags (weight shapes, head counts, eps). Models
    of different shapes get graphs of their own instead of turning each other's dimensions dynamic."""
    return tuple(tuple(tuple(f.shape) if torch.is_tensor(f) else f for f in p) for p in layers)


def compiled_stack(signature: tuple, r0: Optional[int], r1: Optional[int]):
    """``_stack`` compiled for layers of ``signature`` and the last layer's query rows [r0, r1) (all rows when None),
    built on first use with inductor's C++ wrapper (no Python launch per kernel). The number of kept rows is dynamic
    from the start (the caller marks it); another batch size or step length makes that dimension dynamic too."""
    key = (signature, r0, r1)
    fn = _COMPILED.get(key)
    if fn is None:
        def run(layers, x, cos, sin, mask, ks, vs, index, keep):
            return _stack(layers, x, cos, sin, mask, ks, vs, index, keep, r0, r1)
        # Dynamo keeps its graphs and recompile budget per code object, and what it has seen of each input's sizes
        # (which turns a size that changed into a symbolic one) per code name and place: a renamed copy of the code
        # per key keeps one model's sizes from making another's dynamic or spending its budget of 8 graphs.
        run.__code__ = run.__code__.replace(co_name=f"compiled_stack_{next(_CODE_NAMES)}")
        fn = _COMPILED[key] = torch.compile(run, fullgraph=True, options={"cpp_wrapper": True})
    return fn


def run_compiled(layers: list, x, cos, sin, mask, signature: tuple, slots, rows: Optional[range], keep) -> torch.Tensor:
    """A cached step's layer stack through ``compiled_stack`` (``signature`` of ``layers``, ``slots`` from
    ``KVCache.slot_writes``)."""
    r0, r1 = (None, None) if rows is None else (rows.start, rows.stop)
    if keep is not None:
        torch._dynamo.mark_dynamic(keep, 0)  # the number of masked positions changes every step
    return compiled_stack(signature, r0, r1)(layers, x, cos, sin, mask, *slots, keep)
