"""Building blocks of the native decoder: RMSNorm, RoPE (full or partial), attention with an explicit
KV-cache write path and three backends, SwiGLU MLP, and sparse MoE blocks with softmax or sigmoid
group-limited routing. Module and parameter names follow Hugging Face Llama/Qwen naming
(``self_attn.q_proj``, ``mlp.gate_proj`` ...), so LoRA target names are the familiar ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelArch, MoESpec, RopeScaling
from .cache import KVCache
from . import planning
from .experts import GroupedExperts, route
from .fused import FusedProjections
from .outputs import QuerySel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and not (
            torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # Inference: one call, the same bits as the ops below. Not under autograd: its fused backward rounds
        # differently from theirs (~1e-7), and training must stay bit for bit what it was.
        return F.rms_norm(x, weight.shape, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed in fp32 from fp32 inverse frequencies.

    ``inv_freq`` is deliberately not a buffer, so ``model.to(bfloat16)`` cannot round it. LLaDA2's
    model-card recipe (``from_pretrained`` then ``.to(bfloat16)``) does round it; ``follow_dtype``
    reproduces that by rounding to the activation dtype, which is what its bf16 reference logits need.

    Returns ``cos`` and ``sin`` shaped [B, L, 1, R] (broadcast over heads), ``sin`` with its first half negated:
    ``rotate_half(x) * sin == x.roll(R/2) * signed_sin`` exactly (only signs move), one op instead of four.
    """

    def __init__(self, rotary_dim: int, theta: float, follow_dtype: bool = False,
                 scaling: Optional[RopeScaling] = None):
        super().__init__()
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        pos_freqs = theta ** exponent  # built on CPU even under a meta-device context
        self.inv_freq = 1.0 / pos_freqs
        self.attention_factor = 1.0
        if scaling is not None:
            self.inv_freq = yarn_inv_freq(pos_freqs, rotary_dim, theta, scaling)
            self.attention_factor = scaling.attention_factor
        self.follow_dtype = follow_dtype
        self._tables: dict = {}

    def _compute(self, position_ids: torch.Tensor, dtype: torch.dtype):
        inv = self.inv_freq.to(dtype).float() if self.follow_dtype else self.inv_freq
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # YaRN's, in fp32 before the cast (as transformers)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        sin = sin.to(dtype)
        half = sin.shape[-1] // 2
        return cos.to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        if position_ids.device.type != "cpu":  # a table lookup would need the largest position on the host
            cos, sin = self._compute(position_ids, dtype)
            return cos.unsqueeze(2), sin.unsqueeze(2)
        # On CPU: rows of a table of every position seen so far (the same values: cos/sin are elementwise),
        # one lookup per forward instead of several small ops.
        needed = int(position_ids.max()) + 1 if position_ids.numel() else 1
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < needed:
            size = max(needed, 2 * (table[0].shape[0] if table is not None else 0), 256)
            table = self._compute(torch.arange(size, device=position_ids.device), dtype)
            self._tables[dtype] = table
        return F.embedding(position_ids, table[0]).unsqueeze(2), F.embedding(position_ids, table[1]).unsqueeze(2)


def yarn_inv_freq(pos_freqs: torch.Tensor, rotary_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's inverse frequencies from the plain ones' denominators ``pos_freqs = theta ** (2i / rotary_dim)``:
    1 / (factor * pos_freqs) for the dimensions that turn fewer than ``beta_slow`` times over the original context,
    1 / pos_freqs for those that turn more than ``beta_fast`` times, linearly blended between (transformers'
    ``_compute_yarn_parameters``, the same float32 ops)."""
    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the context
        span = scaling.original_max_position_embeddings
        return rotary_dim * math.log(span / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by the factor
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def query_scale(position_ids: torch.Tensor, beta: float, span: int, dtype: torch.dtype) -> torch.Tensor:
    """Llama 4's query scale [B, 1, L, 1] (broadcast over heads and head dimensions of [B, H, L, D] queries):
    1 + beta * log(1 + floor(position / span)), computed in fp32 and cast to the activations' dtype (Ministral 3)."""
    scale = 1 + beta * torch.log(1 + torch.floor(position_ids.float() / span))
    return scale.to(dtype)[:, None, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full_precision: bool) -> torch.Tensor:
    """x [B, L, H, D] with cos and signed sin [B, L, 1, R] from ``RotaryEmbedding`` (or x [B, H, L, D] with them
    transposed to [B, 1, L, R]), R <= D (partial rotary leaves the tail unrotated)."""
    rot = cos.shape[-1]
    xr = x if rot == x.shape[-1] else x[..., :rot]
    if full_precision and x.dtype != torch.float32:
        xf = xr.float()
        out = (xf * cos.float() + xf.roll(rot // 2, -1) * sin.float()).to(x.dtype)
    else:
        out = xr * cos + xr.roll(rot // 2, -1) * sin
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)



def take_rows(t: torch.Tensor, sel: Optional[QuerySel], dim: int = 1) -> torch.Tensor:
    """Rows ``sel`` of ``t`` along ``dim``: a slice (a view), or positions [B, n] per batch row (a gather)."""
    if sel is None or t.shape[dim] == 1:  # size-1 dimensions broadcast
        return t
    if isinstance(sel, slice):
        return t[(slice(None),) * dim + (sel,)]
    shape = list(t.shape)
    shape[0], shape[dim] = sel.shape[0], sel.shape[1]
    view = [sel.shape[0]] + [1] * (t.dim() - 1)
    view[dim] = sel.shape[1]
    return t.expand(sel.shape[0], *t.shape[1:]).gather(dim, sel.view(view).expand(shape))


def pack_rows(x: torch.Tensor, flat_idx: torch.Tensor) -> torch.Tensor:
    """Rows ``flat_idx`` of ``x [B, n, H]`` counted over the flattened [B * n] rows, packed [k, H]."""
    return x.reshape(-1, x.shape[-1]).index_select(0, flat_idx)


@dataclass
class AttnInputs:
    """How attention is masked for one forward (built once by the model, shared by all layers)."""
    mask: Optional[torch.Tensor] = None  # bool (True = attend) or additive float, broadcastable to [B, H, Lq, Lk]
    block_mask: Any = None  # FlexAttention BlockMask
    cu_seqlens: Optional[torch.Tensor] = None  # flash-attn varlen (packed, bidirectional)
    max_seqlen: int = 0
    cache: Optional[KVCache] = None
    sequence: Any = None  # SequenceGroup: rows are this rank's share; attention swaps to whole sequence, some heads
    query_scale: Optional[torch.Tensor] = None  # [B, 1, L, 1]: queries times it after RoPE (``query_scale``)


_flex_compiled = None


def _flex_attention(q, k, v, block_mask, scale, gqa):
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
    return _flex_compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


class Attention(FusedProjections, nn.Module):
    _fused_groups = {"_fused_qkv": ("q_proj", "k_proj", "v_proj")}  # published separately (not LLaDA2)

    def __init__(self, arch: ModelArch, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        h, d = arch.hidden_size, arch.head_dim
        self.fused = arch.fused_qkv
        if self.fused:
            self.qkv_proj = nn.Linear(h, (arch.num_heads + 2 * arch.num_kv_heads) * d, bias=arch.qkv_bias)
        else:
            self.q_proj = nn.Linear(h, arch.num_heads * d, bias=arch.qkv_bias)
            self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
            self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=False)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps)
        self.rope_full_precision = getattr(arch, "rope_full_precision", False)

    def _project(self, x: torch.Tensor, sel: Optional[QuerySel]):
        """q [B, n, H, D] for the query rows ``sel`` (all rows when None), k and v [B, L, Hk, D], and the [q | k]
        heads as one view when they come from one projection of the same rows (else None)."""
        B, L, _ = x.shape
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused:
            qkv = self.qkv_proj(x).view(B, L, H + 2 * Hk, D)
            qk = qkv[:, :, :H + Hk] if sel is None else None
            return take_rows(qkv[:, :, :H], sel), qkv[:, :, H:H + Hk], qkv[:, :, H + Hk:], qk
        fw = self.live_fused("_fused_qkv")
        if fw is None:
            q = self.q_proj(take_rows(x, sel))
            return q.view(B, q.shape[1], H, D), self.k_proj(x).view(B, L, Hk, D), self.v_proj(x).view(B, L, Hk, D), None
        return project_fused_qkv(x, fw.weight, fw.bias, sel, H, Hk, D)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnInputs,
                query_rows: Optional[QuerySel] = None) -> torch.Tensor:
        """Attention of the rows ``query_rows`` of ``x`` (all rows when None) over every row (and the cache)."""
        q, k, v, qk = self._project(x, query_rows)
        if self.qk_norm:
            q, k, qk = self.q_norm(q), self.k_norm(k), None
        return self.o_proj(attend(q, k, v, qk, cos, sin, attn, query_rows, self.layer_idx, self.rope_full_precision,
                                  self.num_heads, self.num_kv_heads, self.head_dim))


def project_fused_qkv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], sel: Optional[QuerySel],
                      num_heads: int, num_kv_heads: int, head_dim: int):
    """q/k/v from one fused [q; k; v] weight buffer: q [B, n, H, D] for the rows ``sel`` (all when None), k and v
    [B, L, Hk, D], and the [q | k] heads as one view when every row is a query (else None)."""
    B, L, _ = x.shape
    H, Hk, D = num_heads, num_kv_heads, head_dim
    if sel is None:
        qkv = F.linear(x, weight, bias).view(B, L, H + 2 * Hk, D)
        return qkv[:, :, :H], qkv[:, :, H:H + Hk], qkv[:, :, H + Hk:], qkv[:, :, :H + Hk]
    nq = H * D  # only the kept rows need queries; every row needs its key and value
    bq, bkv = (None, None) if bias is None else (bias[:nq], bias[nq:])
    q = F.linear(take_rows(x, sel), weight[:nq], bq)
    kv = F.linear(x, weight[nq:], bkv).view(B, L, 2 * Hk, D)
    return q.view(B, q.shape[1], H, D), kv[:, :, :Hk], kv[:, :, Hk:], None


def attend(q, k, v, qk, cos, sin, attn: AttnInputs, query_rows: Optional[QuerySel], layer_idx: int,
           rope_full_precision: bool, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """RoPE, the cache write and attention of projected (and already q/k-normed) heads: q [B, n, H, D], k and v
    [B, L, Hk, D], ``qk`` the [q | k] heads as one view or None. Returns [B, n, H * D] (before the output projection).
    The head counts come as the layer's ints, not from the shapes: a compiled step keeps them static (a symbolic
    ``H != Hk`` is not a bool that SDPA takes)."""
    B, L = k.shape[:2]
    H, Hk, D = num_heads, num_kv_heads, head_dim
    if qk is not None:  # one RoPE over the q and k heads together
        qk = apply_rope(qk, cos, sin, rope_full_precision)
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)
    else:
        # RoPE on the [B, H, L, D] views, as the plain path always did: under autograd the memory layout decides
        # the order in which weight gradients (q_norm, k_norm) are summed, and training keeps its bits.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        qcos, qsin = take_rows(cos, query_rows).transpose(1, 2), take_rows(sin, query_rows).transpose(1, 2)
        q = apply_rope(q, qcos, qsin, rope_full_precision)
        k = apply_rope(k, cos.transpose(1, 2), sin.transpose(1, 2), rope_full_precision)
    if attn.query_scale is not None:
        q = q * take_rows(attn.query_scale, query_rows, dim=2)
    sp = attn.sequence
    B_out, H_out = B, H
    if sp is not None:  # Ulysses: [all heads, my rows] -> [my heads, all rows] (see sequence_parallel.py)
        if Hk % sp.size:  # key/value heads N does not divide: repeat them up to the query heads
            k, v = (t.repeat_interleave(H // Hk, dim=1) for t in (k, v))
            Hk = H
        q, k, v = (sp.heads_from_sequence(t) for t in (q, k, v))
        H, Hk = H // sp.size, Hk // sp.size
    if attn.cache is not None:
        k, v = attn.cache.write(layer_idx, k, v)
    scale = D ** -0.5
    if attn.cu_seqlens is not None and sp is None:  # flash-attn's [tokens, H, D] output is already row-major
        return _attention_heads(q, k, v, attn, query_rows, scale, H != Hk, H, D, rows_first=True).reshape(B, L, H * D)
    out = _attention_heads(q, k, v, attn, query_rows, scale, H != Hk, H, D)
    if sp is not None:
        out = sp.sequence_from_heads(out)
    return out.transpose(1, 2).reshape(B_out, out.shape[2], H_out * D)


def _attention_heads(q, k, v, attn: AttnInputs, query_rows, scale: float, gqa: bool, H: int, D: int,
                     rows_first: bool = False) -> torch.Tensor:
    """Attention output [B, H, Lq, D] of q [B, H, Lq, D] over k and v [B, Hk, L, D] on the backend ``attn`` picks
    (``rows_first``: flash-attn's output as it comes, [B * L, H, D])."""
    B, L = k.shape[0], k.shape[2]
    if attn.cu_seqlens is not None:
        from flash_attn import flash_attn_varlen_func  # optional GPU kernel
        qf, kf, vf = (t.transpose(1, 2).reshape(B * t.shape[2], t.shape[1], D) for t in (q, k, v))
        out = flash_attn_varlen_func(qf, kf, vf, attn.cu_seqlens, attn.cu_seqlens, attn.max_seqlen, attn.max_seqlen,
                                     softmax_scale=scale, causal=False)
        return out if rows_first else out.view(B, L, H, D).transpose(1, 2)
    if attn.block_mask is not None:
        return _flex_attention(q, k, v, attn.block_mask, scale, gqa)
    mask = take_rows(attn.mask, query_rows, dim=2) if attn.mask is not None and attn.mask.dim() == 4 else attn.mask
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    out = planned_attention(q, k, v, mask, scale, gqa)
    return out if out is not None else F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                      enable_gqa=gqa)


def planned_attention(q, k, v, mask, scale: float, gqa: bool):
    """None, except in a ``dare plan`` simulation for CUDA: there attention is CUDA's memory-efficient kernel
    (output and log-sum-exp kept, no [L, L] probabilities), what SDPA and FlexAttention do on a GPU; the CPU
    kernels a fake CPU tensor would otherwise take keep the probabilities."""
    sim = planning.active()
    if sim is None or not sim.cuda_kernels or not planning.is_fake(q):
        return None
    sim.assume("attention as CUDA's memory-efficient kernel (no [L, L] probabilities kept)")
    if gqa:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool \
            else mask.to(q.dtype)
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, torch.is_grad_enabled(), 0.0, False,
                                                                  scale=scale)[0]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [gate | up] projection output (a scratch tensor: updated in place)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


class MLP(FusedProjections, nn.Module):
    _fused_groups = {"_fused_gate_up": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r} (only SwiGLU/silu is used by the supported families)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fw = self.live_fused("_fused_gate_up")
        if fw is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(silu_mul(F.linear(x, fw.weight)))


class Router(nn.Module):
    """Token -> (top-k weights, top-k expert ids, raw router logits)."""

    def __init__(self, hidden: int, spec: MoESpec, fp32: bool):
        super().__init__()
        self.spec, self.fp32 = spec, fp32
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        if spec.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(spec.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        spec = self.spec
        logits = F.linear(x.float(), self.weight.float()) if self.fp32 else F.linear(x, self.weight)
        if spec.router == "softmax":
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            if spec.expert_bias:  # bias steers the choice only; weights stay the plain softmax probabilities
                idx = torch.topk(probs + self.expert_bias.float(), spec.top_k, dim=-1).indices
                weights = probs.gather(1, idx)
            else:
                weights, idx = torch.topk(probs, spec.top_k, dim=-1)
        else:  # sigmoid scores, bias only for selection, group-limited top-k
            scores = torch.sigmoid(logits.float())
            choice = scores + self.expert_bias.float() if spec.expert_bias else scores
            n = choice.shape[0]
            per_group = spec.num_experts // spec.n_group
            grouped = choice.view(n, spec.n_group, per_group)
            group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
            group_idx = group_scores.topk(spec.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
            allowed = group_mask[:, :, None].expand(n, spec.n_group, per_group).reshape(n, -1)
            masked = choice.masked_fill(~allowed, float("-inf"))
            idx = torch.topk(masked, spec.top_k, dim=-1).indices
            weights = scores.gather(1, idx)
        if spec.norm_topk_prob and spec.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if spec.router != "softmax" else 0.0))
        weights = weights * spec.routed_scaling_factor
        return weights, idx, logits


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        spec = arch.moe
        self.spec = spec
        self.gate = Router(arch.hidden_size, spec, arch.router_fp32)
        self.experts = GroupedExperts(spec.num_experts, arch.hidden_size, spec.intermediate_size)
        if spec.num_shared_experts:
            inter = (spec.shared_intermediate_size or spec.intermediate_size) * spec.num_shared_experts
            self.shared_experts = MLP(arch.hidden_size, inter, arch.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, idx, _ = self.gate(flat)
        routing = route(idx, self.spec.num_experts)
        # Every chosen (token, slot) pair once, grouped by expert; the outputs go back to their token in expert order
        # (the order a loop over the experts adds them in).
        y = self.experts(flat[routing.rows], routing) * weights.to(x.dtype).reshape(-1)[routing.order, None]
        out = torch.zeros_like(flat).index_add_(0, routing.rows, y)
        if self.spec.num_shared_experts:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(arch, layer_idx)
        self.mlp = SparseMoE(arch) if arch.is_moe_layer(layer_idx) else MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttnInputs, query_rows: Optional[QuerySel] = None,
                keep: Optional[torch.Tensor] = None):
        """The layer's output for rows ``query_rows`` of ``x`` (all when None; every row still gives keys/values);
        with ``keep`` (flat indices into those [B * n] rows) only the kept rows go on to the MLP, packed [k, hidden]."""
        x = take_rows(x, query_rows) + self.self_attn(self.input_layernorm(x), cos, sin, attn, query_rows)
        if keep is not None:
            x = pack_rows(x, keep)
        return x + self.mlp(self.post_attention_layernorm(x))
