"""Make tests/assets/fixtures/fastdllmv2-tiny: a tiny random Fast-dLLM v2 in its published layout, with the logits of
the reference model, greedy decodes of the reference ``generate`` and the loss of its training forward.

The reference is the Hub code of Efficient-Large-Model/Fast_dLLM_v2_7B (``modeling.py``, ``configuration.py``,
``config.json``; NVIDIA, Apache-2.0), which pins transformers 4.53.1. The Hub is not reachable here; the copy used is
Satgoy152/DualDiffusion at 189fa7a74a83119647dad36b24363cc4e89370ab, ``FastDLLM-inferencing/Fast_dLLM_v2_7B/``, a
snapshot of the Hub folder whose only edit is a ``steps`` argument of ``generate`` that stops after that many forwards
(default None: the published behaviour, which every case here uses). The reference code is never committed; run this
in a throwaway venv, from the repository root:

    python3 -m venv /tmp/venv-fdllm
    /tmp/venv-fdllm/bin/pip install torch==2.13.0 transformers==4.53.1 safetensors einops
    /tmp/venv-fdllm/bin/python scripts/make_fast_dllm_v2_fixture.py --reference DIR   # DIR: modeling.py, configuration.py, config.json

The mask token's LM-head row is zeroed (a random model would sometimes predict the mask id, and ``generate`` then
writes a mask over a mask forever; the published model never predicts its added mask token). The tiny config is the
published config.json with the sizes shrunk (2 layers, hidden 64, vocabulary 512) and the tiny
fixtures' ids (mask 500, eos 501, pad 502: the published pad 151645 is the embedding's ``padding_idx``, which must be
inside the vocabulary); ``bd_size`` stays 32. ``generate`` is called with ``mask_id=500, stop_token=501``, batch 1 (its
stop test reads row 0 only).
"""
from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests/assets/fixtures/fastdllmv2-tiny"
SOURCE = "Satgoy152/DualDiffusion@189fa7a74a83119647dad36b24363cc4e89370ab FastDLLM-inferencing/Fast_dLLM_v2_7B"
MASK, EOS, PAD = 500, 501, 502
TINY = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_window_layers": 2, "vocab_size": 512, "max_position_embeddings": 1024,
        "bos_token_id": 503, "eos_token_id": EOS, "pad_token_id": PAD, "torch_dtype": "float32",
        "layer_types": ["full_attention", "full_attention"],
        "initializer_range": 0.5}  # "peaky" weights: greedy choices and confidences far from ties
# prompt lengths around the block size 32: shorter (the first block holds the prompt's tail), longer and not a
# multiple (prefill of the whole blocks), a multiple (prefill, then the first token from the last logit), exactly 32
PROMPT_LENGTHS = [5, 40, 64, 32]
SETTINGS = [  # generate() arguments besides the prompt
    dict(max_new_tokens=64, threshold=1, small_block_size=8, block_size=32, use_block_cache=False),
    dict(max_new_tokens=64, threshold=0.9, small_block_size=8, block_size=32, use_block_cache=False),
    dict(max_new_tokens=64, threshold=0.5, small_block_size=8, block_size=32, use_block_cache=False),
    dict(max_new_tokens=64, threshold=0.9, small_block_size=8, block_size=32, use_block_cache=True),
    dict(max_new_tokens=96, threshold=0.7, small_block_size=16, block_size=32, use_block_cache=False),
]


def load_reference(folder: Path):
    """Import the Hub files as a package (modeling.py imports ``.configuration``)."""
    pkg = Path(tempfile.mkdtemp()) / "fast_dllm_v2_ref"
    pkg.mkdir()
    for name in ("modeling.py", "configuration.py"):
        shutil.copy(folder / name, pkg / name)
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("fast_dllm_v2_ref.modeling"), importlib.import_module("fast_dllm_v2_ref.configuration")


def run(folder: Path) -> None:
    modeling, configuration = load_reference(folder)
    published = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in {**published, **TINY}.items() if k not in ("architectures", "auto_map", "transformers_version")}
    config = configuration.Fast_dLLM_QwenConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = modeling.Fast_dLLM_QwenForCausalLM(config).float().eval()
    with torch.no_grad():  # the mask token is never predicted, as in the published model (an added token): a zero
        model.lm_head.weight[MASK] = 0.0  # LM-head row, else generate() loops forever writing a mask over a mask
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    saved = json.loads((OUT / "config.json").read_text())  # the published keys, as the Hub's config.json has them
    saved.update(architectures=published["architectures"], auto_map=published["auto_map"])
    (OUT / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (3, 48), generator=g)
    ids[0, 36:44] = MASK  # a masked span in the second block, as a denoising step sees it
    ids[1, 33:48:2] = MASK
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # eval forward: block-causal over blocks of 32, unshifted rows
    torch.save({"input_ids": ids, "logits": logits.float(), "block_size": 32}, OUT / "expected_logits.pt")

    record_training_loss(model)

    cases = []
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(0, 500, (1, length), generator=g)
        for setting in SETTINGS:
            with torch.no_grad():
                out = model.generate(prompt.clone(), mask_id=MASK, stop_token=EOS, temperature=0, top_p=0.95, **setting)
            case = {"decoder": "fast_dllm_v2.generate", "prompt": prompt[0].tolist(), **setting, "mask_id": MASK, "stop_token": EOS,
                    "temperature": 0, "top_p": 0.95, "output": out[0].tolist(), "required": length != 32}
            if length == 32:
                case["not_required_because"] = ("a prompt of exactly block_size tokens skips the prefill (it needs "
                                                "more than block_size) and decodes a fresh block without a cache: "
                                                "the prompt is never attended to (a reference quirk)")
            cases.append(case)
    meta = {"reference": SOURCE + " modeling.py generate", "transformers": __import__("transformers").__version__,
            "torch": torch.__version__, "mask_token_id": MASK, "eos_token_id": EOS, "pad_token_id": PAD,
            "cases": cases}
    (OUT / "expected_generate.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {OUT}: {len(cases)} decodes")


def record_training_loss(model) -> None:
    """expected_loss.pt: the reference's training forward (train mode, ``labels`` given) on two rows of two blocks,
    with the prompt's labels -100. It draws one t per block of 32 (``torch.rand((b,))``), then the token draws
    (``torch.rand((b, l))``); masks the answer tokens with draw < (1 - 1e-3) t + 1e-3 and, in a second batch row
    group, the answer tokens it left visible (the complement), each over [x_t ; x_0]; and returns the shifted
    next-token cross-entropy over every masked answer token of both, averaged. The draws are recorded as drawn."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 500, (2, 64), generator=g)
    labels = ids.clone()
    labels[0, :20] = -100  # prompts of 20 and 41 tokens
    labels[1, :41] = -100
    draws, rand = [], torch.rand

    def recording_rand(*args, **kwargs):
        out = rand(*args, **kwargs)
        draws.append(out.clone())
        return out

    # Its training attention is FlexAttention under torch.compile (CUDA kernels); on this CPU the same op runs eager.
    from torch.nn.attention.flex_attention import flex_attention
    modeling = sys.modules[type(model).__module__]
    modeling.fused_flex_attention = lambda q, k, v, mask=None: flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    model.train()
    torch.manual_seed(3)
    torch.rand = recording_rand
    try:
        with torch.no_grad():  # the loss's value; FlexAttention has no backward on a CPU
            loss = model(input_ids=ids.clone(), labels=labels.clone(), mask_id=MASK).loss
    finally:
        torch.rand = rand
        model.eval()
    assert [tuple(d.shape) for d in draws] == [(4,), (4, 32)], [d.shape for d in draws]
    torch.save({"input_ids": ids, "labels": labels, "t_draws": draws[0], "token_draws": draws[1], "eps": 1e-3,
                "block_size": 32, "loss": loss.detach().float()}, OUT / "expected_loss.pt")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True,
                    help="a folder with the Hub's modeling.py, configuration.py and config.json")
    run(ap.parse_args().reference)
