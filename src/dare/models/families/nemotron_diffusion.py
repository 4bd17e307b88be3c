"""Nemotron-Labs-Diffusion (``model_type: nemotron_labs_diffusion``; NVIDIA's 3B / 8B text models).

A Ministral-3 decoder (Llama layout: RMSNorm, SwiGLU, GQA, no biases) with YaRN RoPE and Llama 4's query scale,
converted to masked diffusion: the published paradigm (``dlm_paradigm: "bidirectional"``) attends fully bidirectionally
and its logits are not shifted (row i predicts token i, as LLaDA's). The published tensors are the backbone's under
``encoder.`` and an untied ``diffusion_head``; both map onto dare's Llama names. The mask id is the config's
``mask_token_id`` (100 as published).

Its decoders also run the same weights causally (row i then predicts token i + 1; ``adapter.causal_mode``): the
masked sampler's ``cache="causal"`` is its ``generate`` (and, with blocks of one token, ``ar_generate``),
``speculative=True`` its ``linear_spec_generate`` (docs/samplers.md). It trains as its published paradigm does
(``dlm_paradigm: "bidirectional"``: LLaDA's NELBO), or as its ``block_diff`` paradigm with SFT's ``block_diff``.
Reference: the Hub code of nvidia/Nemotron-Labs-Diffusion (``modeling_nemotron_labs_diffusion.py`` with its vendored
``modeling_ministral.py``); the fixture tests/assets/fixtures/nemotron-tiny was made by it
(``scripts/make_nemotron_fixture.py`` says where each file came from).
"""
from __future__ import annotations

import math

from ..adapter import FamilyAdapter
from ..arch import ModelArch, RopeScaling
from .base import FamilySpec, UnsupportedModelError, eos_ids, register_family

_ENC = "encoder.layers.{i}."
_LAYER = "model.layers.{i}."
_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                  "input_layernorm.weight", "post_attention_layernorm.weight")


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope(cfg: dict, name: str) -> tuple[float, RopeScaling | None, float, int]:
    """(theta, YaRN scaling or None, Llama 4 query-scale beta, its span) from ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` + ``rope_theta`` (the 4.x mirror the config class also writes)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UnsupportedModelError(f"{name}: rope_type {kind!r} is not supported by dare's native implementation "
                                    f"(supported: 'default', 'yarn')")
    span = rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings")  # transformers' fallback
    scaling = None
    if kind == "yarn":
        if not span:
            raise UnsupportedModelError(f"{name}: YaRN RoPE needs original_max_position_embeddings or "
                                        f"max_position_embeddings")
        factor = rope.get("factor") or cfg["max_position_embeddings"] / span
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:  # transformers' rule: YaRN's sqrt(1/t) = 0.1 ln(s) + 1, or a ratio of two
            attention_factor = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                                else _mscale(factor))
        scaling = RopeScaling(factor=float(factor), original_max_position_embeddings=int(span),
                              beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                              attention_factor=float(attention_factor), truncate=bool(rope.get("truncate", True)))
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    if beta and not span:
        raise UnsupportedModelError(f"{name}: llama_4_scaling_beta needs original_max_position_embeddings or "
                                    f"max_position_embeddings")
    return theta, scaling, beta, int(span or 1)


class NemotronDiffusion(FamilySpec):
    name = "nemotron_diffusion"
    description = "nemotron_labs_diffusion (NemotronLabsDiffusionModel: Nemotron-Labs-Diffusion-3B, -8B)"
    listing_order = 40
    mask_token_strings = ()
    key_rules = [
        ("encoder.embed_tokens.weight", "model.embed_tokens.weight"),
        ("encoder.norm.weight", "model.norm.weight"),
        ("diffusion_head.weight", "lm_head.weight"),
    ] + [(_ENC + t, _LAYER + t) for t in _LAYER_TENSORS]
    unsupported = {"dlm_paradigm": ("bidirectional",), "hidden_act": ("silu",), "attention_bias": (False,),
                   "mlp_bias": (False,), "sliding_window": (None,), "tie_word_embeddings": (False,)}

    def matches(self, cfg):
        return cfg.get("model_type") == "nemotron_labs_diffusion"

    def arch(self, cfg):
        self.check_supported(cfg)
        heads = cfg["num_attention_heads"]
        theta, scaling, beta, span = _rope(cfg, self.name)
        return ModelArch(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
            query_scale_beta=beta, query_scale_span=span,
        )

    def adapter(self, cfg, mask_token_id):
        eos, stops = eos_ids(cfg)
        return FamilyAdapter(self.name, mask_token_id, eos, cfg.get("pad_token_id"), cfg.get("bos_token_id"),
                             shift_logits=False, attention="bidirectional", stop_token_ids=stops,
                             vocab_size=cfg.get("vocab_size"), causal_mode=True)

    def tiny_config(self):
        return {
            "ar_loss_weight": 1.0, "architectures": ["NemotronLabsDiffusionModel"], "attention_bias": False,
            "attention_dropout": 0.0, "attn_implementation": "sdpa",
            "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                         "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
            "block_size": 32, "bos_token_id": 503, "dlm_loss_weight": None, "dlm_paradigm": "bidirectional",
            "dp_varying_mask_ratio": False, "dtype": "float32", "eos_token_id": 501, "head_dim": 16,
            "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 160,
            "mask_token_id": 500, "max_position_embeddings": 1024, "mlp_bias": False,
            "model_type": "nemotron_labs_diffusion", "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "pad_token_id": None, "rms_norm_eps": 1e-05,
            "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                                "rope_theta": 1000000.0, "rope_type": "yarn"},
            "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
            "transformers_version": "5.0.0", "use_cache": False, "vocab_size": 512,
        }


register_family(NemotronDiffusion())
