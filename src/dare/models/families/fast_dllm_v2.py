"""Fast-dLLM v2 (``model_type: Fast_dLLM_Qwen``; NVIDIA's Fast_dLLM_v2_1.5B / 7B): Qwen2.5 adapted to block diffusion.

Exactly Qwen2 (q/k/v bias, GQA, RMSNorm, SwiGLU) with block-causal attention over blocks of the config's ``bd_size``
(32 as published; bidirectional inside a block, causal across blocks, counted from position 0). Adapted from an AR
model, so the logit row i predicts token i+1, as Dream's (``adapter.prediction_logits``; ``model(...).logits`` stays
unshifted, as the reference's). Tensor names are Qwen2's, so no mapping is needed. The mask token is the tokenizer's
added ``|<MASK>|`` (151665 as published); config.json carries none.

Its decoder (the reference's ``generate``) is dare's block sampler with ``sub_block_length`` (the reference's
``small_block_size``) and a threshold: docs/samplers.md. Reference: the Hub code of Efficient-Large-Model/
Fast_dLLM_v2_7B (``modeling.py``), as snapshotted in Satgoy152/DualDiffusion at 189fa7a; the fixture
tests/assets/fixtures/fastdllmv2-tiny was made by it (``scripts/make_fast_dllm_v2_fixture.py``).
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from .base import eos_ids, register_family
from .dream import Dream


class FastDLLMv2(Dream):
    name = "fast_dllm_v2"
    description = "Fast_dLLM_Qwen (Fast_dLLM_QwenForCausalLM: Fast_dLLM_v2_1.5B, Fast_dLLM_v2_7B)"
    listing_order = 55
    mask_token_strings = ("|<MASK>|",)
    default_block_size = 32

    def matches(self, cfg):
        return cfg.get("model_type") == "Fast_dLLM_Qwen"

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id"), cfg.get("bos_token_id"),
                             shift_logits=True, attention="block_causal",
                             block_size=cfg.get("bd_size") or self.default_block_size, stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"))

    def tiny_config(self):
        return {
            "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
            "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                         "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
            "bd_size": 32, "bos_token_id": 503, "conplemenrary_mask": True, "eos_token_id": 501, "hidden_act": "silu",
            "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 160, "mask_token_id": 500,
            "max_position_embeddings": 1024, "max_window_layers": 2, "model_type": "Fast_dLLM_Qwen",
            "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": 502,
            "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
            "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "use_sliding_window": False,
            "vocab_size": 512,
        }


register_family(FastDLLMv2())
