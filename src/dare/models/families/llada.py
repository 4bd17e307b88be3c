"""LLaDA-8B / LLaDA-1.5 (``model_type: llada``, ``LLaDAModelLM``).

Architecturally Llama-3 (RMSNorm, SwiGLU, RoPE with rotate_half, untied head, plain MHA) behind OLMo-style
config keys and tensor names; attention is fully bidirectional and logits are not shifted. The native
module tree uses Llama names, so only the tensor names are mapped.
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from ..arch import ModelArch
from .base import FamilySpec, eos_ids, first, register_family

_BLOCK = "model.transformer.blocks.{i}."
_LAYER = "model.layers.{i}."


class LLaDA(FamilySpec):
    name = "llada"
    description = "llada (LLaDAModelLM: LLaDA-8B, LLaDA-1.5)"
    listing_order = 10
    mask_token_strings = ("<|mdm_mask|>",)
    key_rules = [
        ("model.transformer.wte.weight", "model.embed_tokens.weight"),
        ("model.transformer.ln_f.weight", "model.norm.weight"),
        ("model.transformer.ff_out.weight", "lm_head.weight"),
        (_BLOCK + "attn_norm.weight", _LAYER + "input_layernorm.weight"),
        (_BLOCK + "q_proj.weight", _LAYER + "self_attn.q_proj.weight"),
        (_BLOCK + "k_proj.weight", _LAYER + "self_attn.k_proj.weight"),
        (_BLOCK + "v_proj.weight", _LAYER + "self_attn.v_proj.weight"),
        (_BLOCK + "q_proj.bias", _LAYER + "self_attn.q_proj.bias"),
        (_BLOCK + "k_proj.bias", _LAYER + "self_attn.k_proj.bias"),
        (_BLOCK + "v_proj.bias", _LAYER + "self_attn.v_proj.bias"),
        (_BLOCK + "attn_out.weight", _LAYER + "self_attn.o_proj.weight"),
        (_BLOCK + "ff_norm.weight", _LAYER + "post_attention_layernorm.weight"),
        (_BLOCK + "ff_proj.weight", _LAYER + "mlp.gate_proj.weight"),
        (_BLOCK + "up_proj.weight", _LAYER + "mlp.up_proj.weight"),
        (_BLOCK + "ff_out.weight", _LAYER + "mlp.down_proj.weight"),
    ]
    size_keys = {
        "hidden_size": ("d_model",), "num_layers": ("n_layers",), "num_heads": ("n_heads",),
        "num_kv_heads": ("n_kv_heads",), "intermediate_size": ("mlp_hidden_size",),
        "vocab_size": ("vocab_size", "embedding_size"),
    }
    unsupported = {
        "block_type": ("llama",),
        "layer_norm_type": ("rms",),
        "alibi": (False,),
        "scale_logits": (False,),
        "input_emb_norm": (False,),
        "attention_layer_norm": (False,),
        "include_bias": (False,),
        "multi_query_attention": (None, False),
        "block_group_size": (1,),
        "activation_type": ("silu", "swiglu"),
    }

    def matches(self, cfg):
        return cfg.get("model_type") == "llada" and "LLaDAMoEModelLM" not in (cfg.get("architectures") or []) and (
            "d_model" in cfg or "hidden_size" not in cfg)

    def arch(self, cfg):
        self.check_supported(cfg)
        d, heads = cfg["d_model"], cfg["n_heads"]
        inter = first(cfg, "mlp_hidden_size", default=cfg.get("mlp_ratio", 4) * d)
        return ModelArch(
            vocab_size=first(cfg, "embedding_size", "vocab_size"),
            hidden_size=d, num_layers=cfg["n_layers"], num_heads=heads,
            num_kv_heads=first(cfg, "n_kv_heads", default=heads), head_dim=d // heads,
            intermediate_size=inter, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", 10000.0), qkv_bias=bool(cfg.get("include_qkv_bias", False)),
            tie_word_embeddings=bool(cfg.get("weight_tying", False)),
            rope_full_precision=bool(cfg.get("rope_full_precision", True)),
        )

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id"), cfg.get("bos_token_id"),
                             shift_logits=False, attention="bidirectional", stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"))

    def tiny_config(self):
        return {
            "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
            "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
            "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                         "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
            "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 64,
            "embedding_dropout": 0.0, "embedding_size": 512, "eos_token_id": 501, "flash_attention": False,
            "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "cpu",
            "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
            "layer_norm_with_affine": True, "mask_token_id": 500, "max_sequence_length": 1024, "mlp_hidden_size": 160,
            "mlp_ratio": 2, "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4,
            "n_layers": 2, "pad_token_id": 501, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
            "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
            "torch_dtype": "float32", "use_cache": False, "vocab_size": 512, "weight_tying": False,
        }


register_family(LLaDA())
