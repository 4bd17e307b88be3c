"""LLaDA2.0 / LLaDA2.1 (``model_type: llada2_moe``, ``LLaDA2MoeModelLM``; Ling-2.0 / BailingMoeV2 style).

Our own implementation of the MoE decoder: fused ``query_key_value`` projection split [q | k | v], per-head
QK RMSNorm, partial RoPE (``rotary_dim`` = head_dim * partial_rotary_factor), layer 0 dense and the rest MoE
with a sigmoid router in fp32, an ``expert_bias`` buffer used only for selection, group-limited top-k
(group score = sum of its top-2), top-k weights renormalised and scaled by ``routed_scaling_factor``, plus
a shared expert. Block-causal attention; the block length (32) is a decoding parameter, not a config key.
The model card loads then casts to bf16, which also rounds the RoPE frequencies: reproduced in bf16.
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from ..arch import ModelArch, MoESpec
from .base import FamilySpec, eos_ids, first, register_family

_P = "model.layers.{i}."


class LLaDA2(FamilySpec):
    name = "llada2_moe"
    description = "llada2_moe (LLaDA2MoeModelLM: LLaDA2.0 / LLaDA2.1 mini and flash)"
    listing_order = 60
    mask_token_strings = ("<|mask|>",)
    default_block_size = 32
    key_rules = [
        ("model.word_embeddings.weight", "model.embed_tokens.weight"),
        (_P + "attention.query_key_value.weight", _P + "self_attn.qkv_proj.weight"),
        (_P + "attention.query_key_value.bias", _P + "self_attn.qkv_proj.bias"),
        (_P + "attention.query_layernorm.weight", _P + "self_attn.q_norm.weight"),
        (_P + "attention.key_layernorm.weight", _P + "self_attn.k_norm.weight"),
        (_P + "attention.dense.weight", _P + "self_attn.o_proj.weight"),
    ]
    unsupported = {"rope_scaling": (None,), "norm_head": (False,), "use_rmsnorm": (True,), "use_bias": (False,),
                   "use_sliding_window": (False,), "hidden_act": ("silu",), "norm_softmax": (False,),
                   "score_function": ("sigmoid", "softmax")}

    def matches(self, cfg):
        return cfg.get("model_type") == "llada2_moe"

    def arch(self, cfg):
        self.check_supported(cfg)
        n, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        rotary = first(cfg, "rotary_dim", default=int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
        sigmoid = cfg.get("score_function", "sigmoid") == "sigmoid"
        spec = MoESpec(
            num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"], intermediate_size=cfg["moe_intermediate_size"],
            router="sigmoid_grouped" if sigmoid else "softmax", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
            expert_bias=bool(cfg.get("moe_router_enable_expert_bias", False)),
            num_shared_experts=cfg.get("num_shared_experts") or 0, shared_intermediate_size=cfg["moe_intermediate_size"],
        )
        k = cfg.get("first_k_dense_replace", 0)
        return ModelArch(
            vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=n, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0), rotary_dim=rotary, qkv_bias=bool(cfg.get("use_qkv_bias", False)),
            qk_norm=bool(cfg.get("use_qk_norm", True)), fused_qkv=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=spec, moe_layers=list(range(k, n)), rope_inv_freq_follows_dtype=True, router_fp32=True,
        )

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        if eos is None:
            eos = cfg.get("pad_token_id")  # the published config carries only pad (= <|endoftext|> = eos)
            stops = [eos] if eos is not None else []
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id"), cfg.get("bos_token_id"),
                             shift_logits=False, attention="block_causal",
                             block_size=cfg.get("block_size") or self.default_block_size, stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"))

    def tiny_config(self):
        return {
            "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig", "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                         "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
            "dtype": "float32", "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 16, "hidden_act": "silu",
            "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 160, "max_position_embeddings": 32768,
            "max_window_layers": 28, "model_type": "llada2_moe", "moe_intermediate_size": 32,
            "moe_router_enable_expert_bias": True, "n_group": 4, "norm_head": False, "norm_softmax": False,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "num_shared_experts": 1, "output_dropout": 0.0,
            "output_router_logits": False, "pad_token_id": 501, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 600000, "rotary_dim": 8, "routed_scaling_factor": 2.5,
            "router_dtype": "fp32", "score_function": "sigmoid", "sliding_window": 4096, "tie_word_embeddings": False,
            "topk_group": 2, "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False,
            "use_rmsnorm": True, "use_sliding_window": False, "using_split_qkv_in_self_attention": False,
            "vocab_size": 512,
        }


register_family(LLaDA2())
