"""Make tests/assets/fixtures/rnd1-tiny: a tiny random RND1 in its published layout, with the logits of the
reference model and greedy decodes of the reference sampler.

The reference is RadicalNumerics/RND1 (Apache-2.0) at 87d5f465259c221465c3d1b44c385496e28d4c18: ``rnd/modeling_rnd.py``
(RND1LM, "based on transformers v4.57.0 modeling_qwen3_moe.py"), ``rnd/configuration_rnd.py`` and
``rnd/sampling.py`` (``diffusion_sample``). Its code is never committed here; run this script in a throwaway venv
with the transformers it was written against, from the repository root:

    python3 -m venv /tmp/venv-rnd1
    /tmp/venv-rnd1/bin/pip install torch==2.13.0 transformers==4.57.0 safetensors
    git clone https://github.com/RadicalNumerics/RND1 /tmp/RND1
    git -C /tmp/RND1 checkout 87d5f465259c221465c3d1b44c385496e28d4c18
    /tmp/venv-rnd1/bin/python scripts/make_rnd1_fixture.py --reference /tmp/RND1

One deviation, forced by the reference: ``RND1Config.__init__`` overwrites every size with Qwen3-30B-A3B's
(``CONFIG_DEFAULTS``, applied after the keyword arguments), so no tiny config can be loaded through it as published.
This script replaces those defaults by the tiny sizes before it builds the model; every other line of the reference
runs as published. The saved ``config.json`` holds the keys ``RND1Config.to_dict`` writes (``model_type: rnd1``,
``auto_map``, ``mask_token_id``, the Qwen3-MoE keys), sizes shrunk.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests/assets/fixtures/rnd1-tiny"
COMMIT = "87d5f465259c221465c3d1b44c385496e28d4c18"
MASK, EOS, PAD = 500, 501, 502  # the tiny fixtures' convention (vocab 512, mask 500, eos 501)
TINY = {
    "head_dim": 16, "hidden_size": 64, "intermediate_size": 160, "max_position_embeddings": 1024,
    "max_window_layers": 2, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 512,
    "eos_token_id": EOS, "pad_token_id": PAD, "dtype": "float32",
    # "peaky" weights, so that greedy choices and entropy orders are far from ties
    "initializer_range": 0.5,
}
PROMPTS = [[5, 9, 33, 40, 41, 7, 100], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 300]]
# diffusion_sample settings: (seq_len - prompt length, num_steps); 13 masks in 4 steps exercises the floor schedule
SETTINGS = [(16, 16), (16, 4), (14, 5), (24, 8)]


def build(reference: Path):
    sys.path.insert(0, str(reference))
    import rnd.configuration_rnd as conf
    conf.CONFIG_DEFAULTS.update(TINY)  # the one deviation (module docstring)
    from rnd import RND1Config, RND1LM
    config = RND1Config(mask_token_id=MASK, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = RND1LM(config).float().eval()
    return model


def run(reference: Path) -> None:
    model = build(reference)
    from rnd.sampling import diffusion_sample  # after build(): it puts the reference on the path
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (3, 24), generator=g)
    ids[0, 10:18] = MASK  # masked spans, as a denoising step sees them
    ids[1, 3:24:2] = MASK
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save({"input_ids": ids, "logits": logits.float()}, OUT / "expected_logits.pt")
    cases = []
    for prompt in PROMPTS:
        for gen, steps in SETTINGS:
            x = diffusion_sample(model, seq_len=len(prompt) + gen, num_steps=steps, greedy=True, temperature=1.0,
                                 mask_token_id=MASK, prefix_ids=torch.tensor(prompt), eos_token_id=EOS,
                                 pad_token_id=PAD)
            cases.append({"decoder": "rnd1.diffusion_sample", "prompt": prompt, "seq_len": len(prompt) + gen, "num_steps": steps,
                          "greedy": True, "temperature": 1.0, "top_k": None, "top_p": None, "eb_gamma": None,
                          "mask_token_id": MASK, "eos_token_id": EOS, "pad_token_id": PAD,
                          "output": x[0].tolist(), "required": True})
    meta = {"reference": f"RadicalNumerics/RND1@{COMMIT} rnd/sampling.py diffusion_sample",
            "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "eos_token_id": EOS, "pad_token_id": PAD, "mask_token_id": MASK, "cases": cases}
    (OUT / "expected_generate.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} decodes")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True, help="a checkout of RadicalNumerics/RND1 at " + COMMIT)
    run(ap.parse_args().reference)
