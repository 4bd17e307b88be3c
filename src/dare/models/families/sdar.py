"""SDAR (``model_type: sdar``, Qwen3) and SDAR-30B-A3B (``sdar_moe``, Qwen3-MoE): block diffusion.

Attention is block-causal over absolute positions (bidirectional inside a block, causal across blocks,
blocks counted from position 0), which makes caching finished blocks exact. Logits are not shifted.
Tensor names are the Qwen3 / Qwen3-MoE names. SDAR-MoE's published config has no ``block_size`` or
``mask_token_id``: the block size defaults to 4 (what the SDAR models are trained with) and the mask id
comes from the tokenizer (``<|MASK|>``) or the caller.
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from ..arch import ModelArch, MoESpec
from .base import FamilySpec, eos_ids, register_family


def _qwen3_arch(cfg: dict, **extra) -> ModelArch:
    heads = cfg["num_attention_heads"]
    return ModelArch(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=cfg.get("rope_theta", 10000.0),
        qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), **extra,
    )


class SDAR(FamilySpec):
    name = "sdar"
    description = "sdar (SDARForCausalLM: SDAR-1.7B/4B/8B)"
    listing_order = 40
    mask_token_strings = ("<|MASK|>", "<MASK>")
    default_block_size = 4
    unsupported = {"rope_scaling": (None,), "use_sliding_window": (False,), "hidden_act": ("silu",)}

    def matches(self, cfg):
        return cfg.get("model_type") == "sdar"

    def arch(self, cfg):
        self.check_supported(cfg)
        return _qwen3_arch(cfg)

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id", eos), cfg.get("bos_token_id"),
                             shift_logits=False, attention="block_causal",
                             block_size=cfg.get("block_size") or self.default_block_size, stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"))

    def tiny_config(self):
        return {
            "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "attn_implementation": "flex_attention",
            "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                         "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
            "block_size": 4, "bos_token_id": 501, "debug": False, "eos_token_id": 501, "ep_size": 1,
            "fuse_cross_entropy": True, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 160, "mask_token_id": 500, "max_position_embeddings": 32768, "max_window_layers": 28,
            "micro_forward": False, "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
            "skip_checkpoint": False, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
            "use_cache": False, "use_deepep": False, "use_sliding_window": False, "vocab_size": 512,
        }


class SDARMoE(SDAR):
    name = "sdar_moe"
    description = "sdar_moe (SDARMoeForCausalLM: SDAR-30B-A3B)"
    listing_order = 50

    def matches(self, cfg):
        return cfg.get("model_type") == "sdar_moe"

    def arch(self, cfg):
        self.check_supported(cfg)
        n = cfg["num_hidden_layers"]
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense_only = set(cfg.get("mlp_only_layers") or [])
        moe_layers = [i for i in range(n) if i not in dense_only and cfg.get("num_experts", 0) > 0 and (i + 1) % step == 0]
        spec = MoESpec(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["moe_intermediate_size"], router="softmax",
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
        # Qwen3-MoE runs the router linear in the activation dtype and the softmax in fp32.
        return _qwen3_arch(cfg, moe=spec, moe_layers=moe_layers, router_fp32=False)

    def tiny_config(self):
        return {
            "architectures": ["SDARMoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig", "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                         "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
            "bos_token_id": 501, "decoder_sparse_step": 1, "eos_token_id": 501, "head_dim": 16, "hidden_act": "silu",
            "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 160, "max_position_embeddings": 32768,
            "max_window_layers": 48, "mlp_only_layers": [], "model_type": "sdar_moe", "moe_intermediate_size": 32,
            "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
            "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
            "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 512,
        }


register_family(SDAR())
register_family(SDARMoE())
