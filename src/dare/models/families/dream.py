"""Dream-v0 / Dream-Coder / DiffuCoder (``model_type: Dream``).

Exactly Qwen2 (QKV bias, GQA, RMSNorm, SwiGLU) with bidirectional attention. Dream is initialised from an
AR model, so the logit row i predicts token i+1: samplers and losses read ``adapter.prediction_logits``
(a right shift by one position; row 0 reuses itself), while ``model(...).logits`` stays unshifted as in
the reference. Tensor names are the Qwen2 names, so no mapping is needed.
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from ..arch import ModelArch
from .base import FamilySpec, eos_ids, register_family


class Dream(FamilySpec):
    name = "dream"
    description = "Dream (DreamModel: Dream-v0, Dream-Coder, DiffuCoder)"
    listing_order = 30
    mask_token_strings = ("<|mask|>",)
    unsupported = {"rope_scaling": (None,), "use_sliding_window": (False,), "hidden_act": ("silu",)}

    def matches(self, cfg):
        return cfg.get("model_type") == "Dream"

    def arch(self, cfg):
        self.check_supported(cfg)
        heads = cfg["num_attention_heads"]
        return ModelArch(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads), head_dim=cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0), qkv_bias=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id"), cfg.get("bos_token_id"),
                             shift_logits=True, attention="bidirectional", stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"))

    def tiny_config(self):
        return {
            "architectures": ["DreamModel"], "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
            "bos_token_id": 503, "eos_token_id": 501, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
            "intermediate_size": 160, "mask_token_id": 500, "max_position_embeddings": 1024, "max_window_layers": 28,
            "model_type": "Dream", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "pad_token_id": 502, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": False,
            "use_sliding_window": False, "vocab_size": 512,
        }


register_family(Dream())
