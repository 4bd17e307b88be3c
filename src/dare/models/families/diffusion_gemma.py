"""DiffusionGemma (``model_type: diffusion_gemma``, ``DiffusionGemmaForBlockDiffusion``): uniform-noise block diffusion.

transformers ships this family (``transformers.models.diffusion_gemma``), so the model is transformers' class behind
dare's API (``builder = "diffusion_gemma"``: ``dare.models.diffusion_gemma.DiffusionGemmaLM``, built and loaded there)
and checkpoints load and save with transformers' own ``from_pretrained`` / ``save_pretrained``: the published layout,
tied weights as transformers ties them, the vision tower kept (frozen, unused: dare is text-only). This spec says what
the family is; what the adapter tells the rest of dare:

* corruption: ``noise="uniform"`` -- corrupted canvas positions hold uniform random vocabulary tokens; there is no
  mask token (``mask_token_id = -1``);
* attention: ``"encoder_decoder"`` -- a causal encoder over the clean context, a bidirectional decoder over one
  canvas of ``canvas_length`` tokens (``block_size``) reading the encoder's KV cache (``dare.models.canvas``);
* logits: soft-capped (``final_logit_softcapping``), unshifted;
* decoding: the entropy-bound canvas sampler (``dare.rollout.canvas``).
"""
from __future__ import annotations

from ..adapter import FamilyAdapter
from ..arch import ModelArch, MoESpec
from .base import FamilySpec, UnsupportedModelError, eos_ids, register_family


def arch_of(text: dict) -> ModelArch:
    """A descriptive ``ModelArch`` (sizes for ``dare models``, the vocabulary check) of the text config."""
    heads = text["num_attention_heads"]
    moe = None
    if text.get("num_experts"):
        moe = MoESpec(num_experts=text["num_experts"], top_k=text["top_k_experts"],
                      intermediate_size=text["moe_intermediate_size"], norm_topk_prob=True)
    n = text["num_hidden_layers"]
    return ModelArch(vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], num_layers=n, num_heads=heads,
                     num_kv_heads=text.get("num_key_value_heads", heads), head_dim=text.get("head_dim") or text["hidden_size"] // heads,
                     intermediate_size=text["intermediate_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                     tie_word_embeddings=True, hidden_act=text.get("hidden_activation", "gelu_pytorch_tanh"), moe=moe,
                     moe_layers=list(range(n)) if moe else [])


class DiffusionGemma(FamilySpec):
    name = "diffusion_gemma"
    description = "diffusion_gemma (DiffusionGemmaForBlockDiffusion: DiffusionGemma-26B-A4B)"
    listing_order = 70
    builder = "diffusion_gemma"  # transformers' DiffusionGemmaForBlockDiffusion behind dare's API
    uses_mask_token = False
    default_block_size = 256  # canvas_length of the published config

    def matches(self, cfg):
        return cfg.get("model_type") == "diffusion_gemma"

    def config_section(self, cfg):
        return cfg.setdefault("text_config", {})

    def arch(self, cfg):
        if cfg.get("tie_word_embeddings", True) is False:
            raise UnsupportedModelError(f"{self.name}: tie_word_embeddings=false (separate encoder and decoder weights) "
                                        f"is not supported; the published model shares them")
        return arch_of(cfg["text_config"])

    def adapter(self, cfg, mask_token_id=-1):
        text = cfg.get("text_config", {})
        eos, stops = eos_ids(text)
        pad = text.get("pad_token_id", 0)
        return FamilyAdapter(self.name, -1, eos, pad, text.get("bos_token_id"), shift_logits=False,
                             attention="encoder_decoder", block_size=cfg.get("canvas_length") or self.default_block_size,
                             stop_token_ids=stops, noise="uniform", vocab_size=text.get("vocab_size"),
                             logit_softcap=text.get("final_logit_softcapping", 30.0))

    def tiny_config(self):
        """transformers' ``DiffusionGemmaConfig`` layout, sizes shrunk: 2 layers (sliding then full attention; other
        layer counts get sliding layers and a full last one), a 4-expert top-2 MoE next to the dense MLP, sliding
        window 8, canvas 4, a 1-layer vision tower."""
        return {
            "architectures": ["DiffusionGemmaForBlockDiffusion"], "boi_token_id": 121, "canvas_length": 4,
            "dtype": "float32", "eoi_token_id": 122, "image_token_id": 120, "initializer_range": 0.02,
            "model_type": "diffusion_gemma", "tie_word_embeddings": True,
            "text_config": {
                "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True, "bos_token_id": 2,
                "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 16, "global_head_dim": 32,
                "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "initializer_range": 0.02,
                "intermediate_size": 96, "layer_types": ["sliding_attention", "full_attention"],
                "max_position_embeddings": 131072, "model_type": "diffusion_gemma_text", "moe_intermediate_size": 32,
                "num_attention_heads": 4, "num_experts": 4, "num_global_key_value_heads": 1, "num_hidden_layers": 2,
                "num_key_value_heads": 2, "pad_token_id": 0, "rms_norm_eps": 1e-06,
                "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                                       "rope_type": "proportional"},
                                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
                "sliding_window": 8, "tie_word_embeddings": True, "top_k_experts": 2,
                "use_bidirectional_attention": "vision", "vocab_size": 512,
            },
            "vision_config": {
                "attention_bias": False, "attention_dropout": 0.0, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
                "hidden_size": 16, "initializer_range": 0.02, "intermediate_size": 32, "max_position_embeddings": 131072,
                "model_type": "gemma4_vision", "num_attention_heads": 2, "num_hidden_layers": 1, "num_key_value_heads": 2,
                "patch_size": 4, "pooling_kernel_size": 3, "position_embedding_size": 64, "rms_norm_eps": 1e-06,
                "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"}, "standardize": False,
                "use_clipped_linears": False,
            },
        }


register_family(DiffusionGemma())
