"""LLaDA-MoE-7B-A1B (``model_type: llada`` with ``architectures: [LLaDAMoEModelLM]``).

OLMoE-like and bidirectional: per-head q/k RMSNorm before RoPE, GQA, softmax router in fp32 with top-k
and, as the reference block hard-codes, *no* renormalisation of the top-k weights; no shared expert.
Logits are not shifted. The published config shares ``model_type`` with dense LLaDA, so the family is
told apart by ``architectures`` (or by its Qwen-style keys). Tensor names are Qwen/OLMoE-style.
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from ..arch import ModelArch, MoESpec
from .base import FamilySpec, eos_ids, register_family


class LLaDAMoE(FamilySpec):
    name = "llada_moe"
    description = "llada (LLaDAMoEModelLM: LLaDA-MoE-7B-A1B)"
    listing_order = 20
    mask_token_strings = ("<|mask|>",)
    size_keys = {**FamilySpec.size_keys, "intermediate_size": ("dense_intermediate_size",)}
    unsupported = {"rope_scaling": (None,), "clip_qkv": (None,), "hidden_act": ("silu",), "attention_bias": (False,)}

    def matches(self, cfg):
        archs = cfg.get("architectures") or []
        return cfg.get("model_type") in ("llada", "lladamoe") and ("LLaDAMoEModelLM" in archs or ("num_experts" in cfg and "d_model" not in cfg))

    def arch(self, cfg):
        self.check_supported(cfg)
        n, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
        head_dim = hidden // heads
        freq = cfg.get("moe_layer_freq", 1)
        flags = freq if isinstance(freq, list) else [1 if (i % max(int(freq), 1) == 0) else 0 for i in range(n)]
        spec = MoESpec(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["expert_intermediate_size"], router="softmax",
                       norm_topk_prob=False,  # hard-coded False in the reference MoE block, whatever the config says
                       expert_bias=bool(cfg.get("moe_router_enable_expert_bias", False)))
        return ModelArch(
            vocab_size=cfg["vocab_size"], hidden_size=hidden, num_layers=n, num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=head_dim,
            intermediate_size=cfg.get("dense_intermediate_size") or cfg.get("intermediate_size") or 4 * hidden,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=cfg.get("rope_theta", 10000.0),
            rotary_dim=int(head_dim * cfg.get("partial_rotary_factor", 1.0)), qk_norm=bool(cfg.get("qk_layernorm", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=spec, moe_layers=[i for i in range(n) if flags[i]], router_fp32=False,
        )

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id"), cfg.get("bos_token_id"),
                             shift_logits=False, attention="bidirectional", stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"))

    def tiny_config(self):
        return {
            "architectures": ["LLaDAMoEModelLM"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_lladamoe.LLaDAConfig", "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
                         "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM"},
            "bos_token_id": None, "clip_qkv": None, "dense_intermediate_size": 160, "eos_token_id": 501,
            "expert_intermediate_size": 32, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "max_position_embeddings": 8192, "model_type": "llada", "moe_layer_freq": [1, 1],
            "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax", "norm_topk_prob": False,
            "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "output_router_logits": False, "pad_token_id": 501, "partial_rotary_factor": 1.0,
            "qk_layernorm": True, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 50000.0,
            "routed_scaling_factor": 1.0, "router_aux_loss_coef": 0.01, "router_num_group": -2, "router_topk_group": -2,
            "shared_expert_intermediate_size": None, "tie_word_embeddings": False, "torch_dtype": "float32",
            "use_cache": False, "vocab_size": 512,
        }


register_family(LLaDAMoE())
