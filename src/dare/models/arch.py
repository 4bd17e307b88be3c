"""The normalised architecture description every family's config.json is mapped onto.

One ``ModelArch`` describes all supported families: dense Llama/Qwen-style decoders (LLaDA, Dream, SDAR),
and MoE decoders with a softmax router (LLaDA-MoE, SDAR-MoE) or a sigmoid group-limited router with expert
bias and a shared expert (LLaDA2.x). Only attention *masks* distinguish diffusion LMs from AR LMs, and
those live in the family adapter, not here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    router: Literal["softmax", "sigmoid_grouped"] = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # sigmoid_grouped (DeepSeek-V3 / Ling-2.0 style) only:
    n_group: int = 1
    topk_group: int = 1
    expert_bias: bool = False
    num_shared_experts: int = 0
    shared_intermediate_size: Optional[int] = None


@dataclass
class RopeScaling:
    """YaRN's RoPE frequency scaling (transformers' ``rope_type: "yarn"``, Peng et al. 2023): the frequencies of the
    dimensions that rotate fewer than ``beta_slow`` times over the original context are divided by ``factor``, those
    that rotate more than ``beta_fast`` times are kept, with a linear ramp between; cos and sin are multiplied by
    ``attention_factor``."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # the ramp's ends rounded to whole dimensions


_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")


class ArchError(ValueError):
    """A size no model can have; ``field`` names the ``ModelArch`` field (a family names its config key)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class ModelArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rotary_dim: Optional[int] = None  # partial RoPE; None = head_dim
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False  # one [q|k|v] projection (LLaDA2)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    moe: Optional[MoESpec] = None
    # Which layers use the MoE block (the others use the dense MLP with ``intermediate_size``).
    moe_layers: list[int] = field(default_factory=list)
    # LLaDA2's model-card recipe casts the RoPE inv_freq buffer with the model (bf16-rounded frequencies).
    rope_inv_freq_follows_dtype: bool = False
    # LLaDA (OLMo code) applies RoPE in fp32 whatever the activation dtype.
    rope_full_precision: bool = False
    # Router logits/weights in fp32 regardless of the model dtype (all published MoE dLLMs do this).
    router_fp32: bool = True
    rope_scaling: Optional[RopeScaling] = None  # None: plain RoPE
    # Llama 4's query scale (Ministral 3): queries after RoPE times 1 + beta * log(1 + floor(position / span)); 1 below
    # ``span``. beta 0: off.
    query_scale_beta: float = 0.0
    query_scale_span: int = 1

    def __post_init__(self):
        for name in _SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArchError(name, f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads and self.head_dim == self.hidden_size // self.num_heads:
            raise ArchError("hidden_size", f"hidden_size {self.hidden_size} is not a multiple of num_heads "
                                           f"{self.num_heads} (head_dim = hidden_size / num_heads)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and <= head_dim {self.head_dim}")
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers given without a MoE spec")

    def is_moe_layer(self, i: int) -> bool:
        return i in self.moe_layers
