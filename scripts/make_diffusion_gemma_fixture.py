"""Make tests/assets/fixtures/diffusiongemma-tiny: a tiny random DiffusionGemma and transformers' own ``generate``.

Everything here is transformers (``DiffusionGemmaForBlockDiffusion``, its config, its ``save_pretrained`` and
``generate``); dare only supplies ``derive_seed``, the map from a dare sampling seed to the torch seed of a row, so
that ``dare.rollout.generate(..., seeds=[seed])`` draws from the same stream as ``torch.manual_seed(torch_seed)``
followed by ``generate``. Each prompt is generated alone (batch 1, no padding), as the reference behaviour.

Run from the repository root: ``.venv/bin/python scripts/make_diffusion_gemma_fixture.py``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

from dare.diffusion.noise import derive_seed

OUT = Path(__file__).resolve().parents[1] / "tests/assets/fixtures/diffusiongemma-tiny"

TEXT = {  # the character tokenizer's eos 1 and bos 3 (dare.models.tokenizer.tiny_tokenizer); pad 0 (its unknown token)
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
    "attention_k_eq_v": True, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 3, "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision",
    # "peaky" weights (std 0.6), so that samples are not all noise and some canvases stop early / hold EOS
    "initializer_range": 0.6,
}
VISION = {"model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
          "position_embedding_size": 64}
PROMPTS = [[5, 9, 33, 40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21], [60, 61, 62, 63, 64, 65, 66]]
# generate() parameters per case family (max_new_tokens 12 = 3 canvases of 4; sliding window 8 < context).
SETTINGS = {
    "defaults": dict(max_denoising_steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1, stability_threshold=1,
                     confidence_threshold=0.005),
    "stable_2": dict(max_denoising_steps=6, t_min=0.2, t_max=1.0, entropy_bound=1.0, stability_threshold=2,
                     confidence_threshold=2.0),
    "confidence_only": dict(max_denoising_steps=6, t_min=0.4, t_max=0.8, entropy_bound=0.5, stability_threshold=0,
                            confidence_threshold=0.4),
}
EOS_SCALE = 1.5  # the EOS embedding row (tied to the LM head) scaled up, so that more completions stop
EOS, PAD = 1, 0  # generation pads after EOS with 0 so that the EOS itself stays visible


def build_model() -> DiffusionGemmaForBlockDiffusion:
    config = DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=4, image_token_id=120,
                                  boi_token_id=121, eoi_token_id=122, initializer_range=0.6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[EOS] *= EOS_SCALE
    return model


def run_case(model, prompt: list[int], seed: int, setting: dict) -> dict:
    torch_seed = derive_seed(seed, "rollout-sample", 0)
    torch.manual_seed(torch_seed)
    initial = torch.randint(0, TEXT["vocab_size"], (1, model.config.canvas_length))[0].tolist()  # its first draw
    torch.manual_seed(torch_seed)
    kw = dict(setting)
    bound = kw.pop("entropy_bound")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, sampler_config=EntropyBoundSamplerConfig(entropy_bound=bound),
                         eos_token_id=EOS, pad_token_id=PAD, **kw)
    gen = out.sequences[0, len(prompt):].tolist()
    valid = sum(t != PAD for t in gen)
    return {"prompt": prompt, "seed": seed, "torch_seed": torch_seed, "initial_canvas": initial, "output": gen,
            "decoder_passes": round(valid / float(out.tokens_per_forward[0])) if valid else None}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    model = build_model()
    model.save_pretrained(str(OUT))
    cases = []
    for name, setting in SETTINGS.items():
        for i, prompt in enumerate(PROMPTS):
            for seed in (1000 * i + 1, 1000 * i + 2):
                case = run_case(model, prompt, seed, setting)
                cases.append({"setting": name, "params": setting, "max_new_tokens": 12, "eos_token_id": EOS,
                              "pad_token_id": PAD, **case})
    meta = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "canvas_length": 4,
            "note": "output = transformers' generate tokens after the prompt (PAD after EOS); torch_seed = "
                    "dare.diffusion.noise.derive_seed(seed, 'rollout-sample', 0); initial_canvas = the first "
                    "randint of that seed (generate's initial canvas)", "cases": cases}
    (OUT / "expected_generate.json").write_text(json.dumps(meta, indent=1) + "\n")
    stops = sum(EOS in c["output"] for c in cases)
    canvases = [-(-(c["output"].index(EOS) + 1 if EOS in c["output"] else 12) // 4) for c in cases]
    early = sum(1 for c, n in zip(cases, canvases) if c["decoder_passes"] < n * c["params"]["max_denoising_steps"])
    print(f"wrote {len(cases)} cases to {OUT} ({stops} with EOS, {early} with fewer passes than the maximum)")


if __name__ == "__main__":
    main()
