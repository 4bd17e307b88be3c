"""RND1 (``model_type: rnd1``; Radical Numerics' RND1-30B-A3B): Qwen3-30B-A3B converted to masked diffusion.

Exactly Qwen3-MoE (q/k RMSNorm per head before RoPE, GQA, no biases, a softmax router whose top-k weights are
renormalised, no shared expert) with fully bidirectional attention, and every layer MoE: the reference ignores
``decoder_sparse_step`` and ``mlp_only_layers``. Converted from an AR model, so the logit row i predicts token i+1,
as Dream's (``adapter.prediction_logits``; ``model(...).logits`` stays unshifted, as the reference's). Tensor names
are Qwen3-MoE's per-expert names, so no mapping is needed. The mask id is the config's ``mask_token_id`` (151669 in
the published one). Reference: RadicalNumerics/RND1 at 87d5f46 (``rnd/modeling_rnd.py``); the fixture
tests/assets/fixtures/rnd1-tiny was made by it (``scripts/make_rnd1_fixture.py``).
"""
from __future__ import annotations

from ..arch import MoESpec
from .base import register_family
from .dream import Dream
from .sdar import _qwen3_arch


class RND1(Dream):  # Dream's adapter: bidirectional, shifted logits, the config's mask id
    name = "rnd1"
    description = "rnd1 (RND1: RND1-30B-A3B)"
    listing_order = 35
    mask_token_strings = ()
    # the reference writes False where Qwen3 writes null for "off"
    unsupported = {"rope_scaling": (None, False), "hidden_act": ("silu",), "attention_bias": (False,),
                   "use_sliding_window": (False,)}

    def matches(self, cfg):
        return cfg.get("model_type") == "rnd1"

    def arch(self, cfg):
        self.check_supported(cfg)
        spec = MoESpec(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["moe_intermediate_size"], router="softmax",
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        # the router linear in the activation dtype and its softmax in fp32, as Qwen3-MoE's
        return _qwen3_arch(cfg, moe=spec, moe_layers=list(range(cfg["num_hidden_layers"])), router_fp32=False)

    def tiny_config(self):
        return {
            "architectures": ["RND1LM"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration_rnd.RND1Config", "AutoModel": "modeling_rnd.RND1Model",
                         "AutoModelForMaskedLM": "modeling_rnd.RND1LM"},
            "decoder_sparse_step": 1, "eos_token_id": 501, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
            "initializer_range": 0.02, "intermediate_size": 160, "is_causal": False, "mask_token_id": 500,
            "max_position_embeddings": 1024, "max_window_layers": 2, "mlp_only_layers": [], "model_type": "rnd1",
            "moe_backend": "hf", "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4,
            "num_diffusion_steps": 256, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "output_router_logits": False, "pad_token_id": 502, "rms_norm_eps": 1e-06,
            "rope_scaling": False, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": False,
            "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": False, "use_sliding_window": False,
            "vocab_size": 512,
        }


register_family(RND1())
