"""DiffusionGemma (``model_type: diffusion_gemma``, ``DiffusionGemmaForBlockDiffusion``): uniform-noise block diffusion.

transformers ships this family (``transformers.models.diffusion_gemma``), so the model is transformers' class behind
dare's API (``dare.models.diffusion_gemma.DiffusionGemmaLM``) and checkpoints load and save with transformers' own
``from_pretrained`` / ``save_pretrained``: the published layout, tied weights as transformers ties them, the vision
tower kept (frozen, unused: dare is text-only). What the adapter tells the rest of dare:

* corruption: ``noise="uniform"`` -- corrupted canvas positions hold uniform random vocabulary tokens; there is no
  mask token (``mask_token_id = -1``);
* attention: ``"encoder_decoder"`` -- a causal encoder over the clean context, a bidirectional decoder over one
  canvas of ``canvas_length`` tokens (``block_size``) reading the encoder's KV cache (``dare.models.canvas``);
* logits: soft-capped (``final_logit_softcapping``), unshifted;
* decoding: the entropy-bound canvas sampler (``dare.rollout.canvas``).
"""
from __future__ import annotations

import contextlib
import json
import logging

from ..adapter import FamilyAdapter
from .base import Family, UnsupportedModelError, eos_ids, register_family

log = logging.getLogger(__name__)


def _hf_config(cfg: dict, attn: str = "sdpa"):
    from transformers import DiffusionGemmaConfig
    cfg = json.loads(json.dumps(cfg))
    text = cfg.get("text_config", {})
    n = text.get("num_hidden_layers")
    if n and len(text.get("layer_types") or []) != n:  # tiny(num_layers=...): sliding layers, the last one full
        text["layer_types"] = ["sliding_attention"] * (n - 1) + ["full_attention"]
    config = DiffusionGemmaConfig.from_dict(cfg)
    config._attn_implementation = attn
    return config


@contextlib.contextmanager
def quiet_transformers():
    """transformers' per-call progress bars (loading / writing shards) stay out of dare's logs."""
    from transformers.utils import logging as hf_logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class DiffusionGemma(Family):
    name = "diffusion_gemma"
    description = "diffusion_gemma (DiffusionGemmaForBlockDiffusion: DiffusionGemma-26B-A4B)"
    uses_mask_token = False
    default_block_size = 256  # canvas_length of the published config

    def matches(self, cfg):
        return cfg.get("model_type") == "diffusion_gemma"

    def config_section(self, cfg):
        return cfg.setdefault("text_config", {})

    def _check(self, cfg: dict) -> None:
        try:
            import transformers.models.diffusion_gemma  # noqa: F401
        except ImportError as e:
            raise UnsupportedModelError(f"{self.name} needs transformers >= 5.x with transformers.models.diffusion_gemma "
                                        f"(pip install -U transformers): {e}") from e
        if cfg.get("tie_word_embeddings", True) is False:
            raise UnsupportedModelError(f"{self.name}: tie_word_embeddings=false (separate encoder and decoder weights) "
                                        f"is not supported; the published model shares them")

    def arch(self, cfg):
        from ..diffusion_gemma import arch_of
        return arch_of(cfg["text_config"])

    def adapter(self, cfg, mask_token_id=-1):
        text = cfg.get("text_config", {})
        eos, stops = eos_ids(text)
        pad = text.get("pad_token_id", 0)
        return FamilyAdapter(self.name, -1, eos, pad, text.get("bos_token_id"), shift_logits=False,
                             attention="encoder_decoder", block_size=cfg.get("canvas_length") or self.default_block_size,
                             stop_token_ids=stops, noise="uniform", vocab_size=text.get("vocab_size"),
                             logit_softcap=text.get("final_logit_softcapping", 30.0))

    # --- models --------------------------------------------------------------------------------------
    def _wrap(self, hf_model, cfg: dict):
        from ..diffusion_gemma import DiffusionGemmaLM
        return DiffusionGemmaLM(hf_model, self.adapter(cfg), cfg, self.name)

    def build(self, cfg, mask_token_id=-1, dtype=None, device=None, attn_backend="auto", init=True):
        self._check(cfg)
        from transformers import DiffusionGemmaForBlockDiffusion
        from ..diffusion_gemma import parameters_on_meta
        config = _hf_config(cfg)
        if init:
            model = self._wrap(DiffusionGemmaForBlockDiffusion(config), cfg)
            return model.to(dtype=dtype, device=device)
        with parameters_on_meta():
            return self._wrap(DiffusionGemmaForBlockDiffusion(config), cfg)

    def load(self, folder, cfg, mask_token_id, dtype, attn_backend="auto"):
        self._check(cfg)
        from transformers import DiffusionGemmaForBlockDiffusion
        from ..loading import CheckpointError
        try:
            with quiet_transformers():
                hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa",
                                                                       output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{folder}: transformers could not load this DiffusionGemma checkpoint: {e}") from e
        missing = [k for k in info.get("missing_keys", []) if k not in hf.all_tied_weights_keys]
        problems = {"missing": missing, "unexpected": list(info.get("unexpected_keys", [])),
                    "mismatched": [str(m) for m in info.get("mismatched_keys", [])]}
        bad = {k: v for k, v in problems.items() if v}
        if bad:
            detail = "; ".join(f"{k} tensor(s) {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for k, v in bad.items())
            raise CheckpointError(f"{folder}: {detail} (config.json implies another architecture)")
        return self._wrap(hf, json.loads((folder / "config.json").read_text()))

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
