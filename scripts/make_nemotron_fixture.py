"""Make tests/assets/fixtures/nemotron-tiny: a tiny random Nemotron-Labs-Diffusion model in its published layout, with
the logits of the reference model (bidirectional and causal), greedy decodes of its three decoders and the loss of
its training forward.

The reference is the Hub code of nvidia/Nemotron-Labs-Diffusion-{3B,8B} (``modeling_nemotron_labs_diffusion.py``,
``configuration_nemotron_labs_diffusion.py`` and the vendored backbone ``modeling_ministral.py``; NVIDIA). The Hub is
not reachable here; the copies used are public GitHub files read through a code index:

- ``modeling_ministral.py`` and ``configuration_nemotron_labs_diffusion.py``: Athe-kunal/thinking-fast-slow at
  4b6f45e9a2e708102c778cd6dfa170d1542130b5, ``src/nemotron/`` (a local copy of the Hub folder);
- ``modeling_nemotron_labs_diffusion.py``: the same folder's file as the index holds it (index file id 56506952231;
  the index names no repository for a file of its size). Its function line numbers agree with an independent guide
  to the Hub file (linyewei526/Nemotron-Labs-Diffusion@5244226 ``configs/basis/..._decode_code_guide_zh.md``);
- ``config.json``: the published 8B config (transformers_version 5.0.0), as quoted in full by several public copies.

The reference code is never committed. Run this in a throwaway venv, from the repository root:

    python3 -m venv /tmp/venv-nld
    /tmp/venv-nld/bin/pip install torch==2.13.0 transformers==5.0.0 safetensors numpy
    /tmp/venv-nld/bin/python scripts/make_nemotron_fixture.py --reference DIR   # DIR: the three .py files + config.json

The tiny config is the published one with the sizes shrunk (2 layers, hidden 64, 4 heads of 16, 2 KV heads,
vocabulary 512) and the fixtures' ids (mask 500, eos 501, bos 503). YaRN and the Llama-4 query scale keep their
published parameters except ``original_max_position_embeddings`` (16384 -> 32, ``max_position_embeddings`` 512 =
16 x 32), so that both act at the fixture's positions (the scale is 1 below the original length). The mask token's
head row is zeroed, as the published model never predicts its mask token (a random one would, and a committed mask
stays a mask). Weights are the reference's init with ``initializer_range`` 0.5 ("peaky": greedy choices far from
ties).
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

OUT = Path(__file__).resolve().parents[1] / "tests/assets/fixtures/nemotron-tiny"
SOURCE = ("Athe-kunal/thinking-fast-slow@4b6f45e9a2e708102c778cd6dfa170d1542130b5 src/nemotron/ (modeling_ministral.py, "
          "configuration_nemotron_labs_diffusion.py); modeling_nemotron_labs_diffusion.py: code-index file 56506952231")
FILES = ("modeling_nemotron_labs_diffusion.py", "configuration_nemotron_labs_diffusion.py", "modeling_ministral.py")
MASK, EOS, BOS = 500, 501, 503
TINY = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 512,
        "mask_token_id": MASK, "eos_token_id": EOS, "bos_token_id": BOS, "torch_dtype": "float32",
        "initializer_range": 0.5}
ORIGINAL_MAX = 32
# generate(): prompt lengths x (max_new_tokens, block_length, threshold, causal_context)
PROMPT_LENGTHS = [5, 12, 40]
GENERATE = [(64, 32, None, True), (64, 32, 0.9, True), (64, 16, 0.5, True), (48, 16, None, False), (64, 32, 0.7, False)]
AR_NEW = 24
SPEC = [(40, 16, 0.0), (40, 8, 0.9)]  # linear_spec_generate: (max_new_tokens, block_length, threshold)


def load_reference(folder: Path):
    """Import the Hub files as a package (they import each other relatively)."""
    pkg = Path(tempfile.mkdtemp()) / "nemotron_ref"
    pkg.mkdir()
    for name in FILES:
        shutil.copy(folder / name, pkg / name)
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(pkg.parent))
    modeling = importlib.import_module("nemotron_ref.modeling_nemotron_labs_diffusion")
    configuration = importlib.import_module("nemotron_ref.configuration_nemotron_labs_diffusion")
    return modeling, configuration


def _set_diffusion_lm(model, value: bool) -> None:
    for layer in model.encoder.layers:
        layer.self_attn.diffusion_lm = value


def _decode(model, decoder: str, prompt: torch.Tensor, eos: int, **settings) -> dict:
    """One greedy decode of the reference's ``decoder`` as a fixture case. Every layer is set back to the published
    paradigm afterwards (``ar_generate`` leaves them causal)."""
    with torch.no_grad():
        out, nfe = getattr(model, decoder)(prompt.clone(), **settings, temperature=0.0, eos_token_id=eos)
    _set_diffusion_lm(model, True)
    return {"decoder": f"nemotron.{decoder}", "prompt": prompt[0].tolist(), **settings, "temperature": 0.0,
            "eos_token_id": eos, "output": out[0].tolist(), "nfe": nfe, "required": True}


def run(folder: Path) -> None:
    modeling, configuration = load_reference(folder)
    published = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in {**published, **TINY}.items() if k not in ("architectures", "auto_map", "transformers_version")}
    cfg["rope_parameters"] = {**published["rope_parameters"], "original_max_position_embeddings": ORIGINAL_MAX}
    config = configuration.NemotronLabsDiffusionConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = modeling.NemotronLabsDiffusionModel(config).float().eval()
    with torch.no_grad():
        model.diffusion_head.weight[MASK] = 0.0
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    saved = json.loads((OUT / "config.json").read_text())
    saved.update(architectures=published["architectures"], auto_map=published["auto_map"])
    (OUT / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (3, 80), generator=g)  # positions past 32 and 64: YaRN and the Llama-4 scale
    ids[0, 36:44] = MASK
    ids[1, 50:80:2] = MASK
    with torch.no_grad():
        bidirectional = model(ids).logits  # the published paradigm: full attention, logit i predicts token i
        _set_diffusion_lm(model, False)
        causal = model(ids, use_causal_mask=True).logits  # the AR mode of the prefill and ar_generate: row i predicts i+1
        _set_diffusion_lm(model, True)
    torch.save({"input_ids": ids, "logits": bidirectional.float(), "logits_causal": causal.float()},
               OUT / "expected_logits.pt")

    cases = []
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(0, 500, (1, length), generator=g)
        for new, block, threshold, causal_context in GENERATE:
            cases.append(_decode(model, "generate", prompt, EOS, max_new_tokens=new, block_length=block,
                                 threshold=threshold, causal_context=causal_context))
        # the stop logic: the same decode with its most frequent generated token as the stop token (the random model
        # never writes the config's eos), so it ends early with the block's or the batch's stop rule
        stop = int(torch.tensor(cases[-len(GENERATE)]["output"][length:]).mode().values)
        for new, block, threshold, causal_context in (GENERATE[0], GENERATE[3]):
            cases.append(_decode(model, "generate", prompt, stop, max_new_tokens=new, block_length=block,
                                 threshold=threshold, causal_context=causal_context))
        cases.append(_decode(model, "ar_generate", prompt, EOS, max_new_tokens=AR_NEW))
        for new, block, threshold in SPEC:
            cases.append(_decode(model, "linear_spec_generate", prompt, EOS, max_new_tokens=new, block_length=block,
                                 threshold=threshold))
    meta = {"reference": SOURCE, "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "mask_token_id": MASK, "eos_token_id": EOS, "bos_token_id": BOS, "cases": cases}
    (OUT / "expected_generate.json").write_text(json.dumps(meta, indent=1) + "\n")
    record_training_loss(model)
    print(f"wrote {OUT}: {len(cases)} decodes")


def _loss_with_draws(model, ids: torch.Tensor, loss_mask: torch.Tensor, seed: int):
    """(loss sum, token count, draws) of the reference's training forward from ``torch.manual_seed(seed)``; the draws
    of its ``forward_process`` recorded as drawn: one t per row (``torch.rand(b)``), then one per token."""
    draws, rand = [], torch.rand

    def recording_rand(*args, **kwargs):
        out = rand(*args, **kwargs)
        draws.append(out.clone())
        return out

    torch.manual_seed(seed)
    torch.rand = recording_rand
    try:
        with torch.no_grad():
            total, count = model(ids.clone(), labels=ids.clone(), loss_mask=loss_mask.clone()).loss
    finally:
        torch.rand = rand
    assert [tuple(d.shape) for d in draws] == [(ids.shape[0],), tuple(ids.shape)], [d.shape for d in draws]
    return total, count, draws


def record_training_loss(model) -> None:
    """expected_loss.pt: the published paradigm's training forward (``labels`` and a ``loss_mask`` that is 0 on the
    prompt) on two rows of 40 tokens (prompts of 9 and 23). ``forward_process`` draws one t per row
    (``torch.rand(b)``), then the token draws (``torch.rand((b, l))``), masks the loss-mask tokens whose draw is below
    (1 - 1e-3) t + 1e-3, and the forward returns (sum of the masked tokens' cross-entropy / p_mask, number of masked
    tokens): the caller divides one by the other. The draws are recorded as drawn."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 500, (2, 40), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :9] = 0
    loss_mask[1, :23] = 0
    total, count, draws = _loss_with_draws(model, ids, loss_mask, seed=8)  # t = 0.60 and 0.85: most tokens masked
    torch.save({"input_ids": ids, "loss_mask": loss_mask, "t_draws": draws[0], "token_draws": draws[1], "eps": 1e-3,
                "loss_sum": total.float(), "masked_tokens": int(count), "loss": (total / count).float()},
               OUT / "expected_loss.pt")


BLOCK_DIFF_BLOCK = 8


def record_block_diff_loss(folder: Path) -> None:
    """expected_loss_block_diff.pt: the ``block_diff`` paradigm's training forward on the fixture's weights (the
    reference's ``NemotronLabsDiffusionFlexAttention``: ``[x_t ; x_0]``, noisy blocks of ``block_size`` 8 seeing
    themselves and the earlier clean blocks, the clean half token-causal; FlexAttention run eagerly, as a CPU allows),
    on two rows of 16 tokens (prompts of 5 and 9) with the draws recorded as for expected_loss.pt. The forward returns
    (diffusion sum + ar_loss_weight x the clean half's next-token cross-entropy sum, masked tokens + ar_loss_weight x
    16); the diffusion sum alone comes from the same draws with ``ar_loss_weight`` 0. 2 x 16 = 32 positions: the
    reference scales a clean query by its index in the doubled input (``cache_position``), dare by its position, the
    same factor (1) while the doubled input is within ``original_max_position_embeddings``."""
    from safetensors.torch import load_file
    from torch.nn.attention.flex_attention import flex_attention
    modeling, configuration = load_reference(folder)
    modeling.fused_flex_attention = flex_attention  # the compiled kernel needs a GPU: the same function, eager
    cfg = json.loads((OUT / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "transformers_version")}
    cfg.update(dlm_paradigm="block_diff", block_size=BLOCK_DIFF_BLOCK)
    config = configuration.NemotronLabsDiffusionConfig(**cfg)
    config._attn_implementation = "sdpa"
    model = modeling.NemotronLabsDiffusionModel(config).float().eval()
    model.load_state_dict(load_file(OUT / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (2, 16), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :5] = 0
    loss_mask[1, :9] = 0
    out = {}
    for weight in (1.0, 0.0):
        model.config.ar_loss_weight = weight
        total, count, draws = _loss_with_draws(model, ids, loss_mask, seed=4)
        out[weight] = (total.double(), int(count), draws, float(model.loss_ar) * ids.shape[1])
    (total, count, draws, ar_sum), (diffusion, masked, _, _) = out[1.0], out[0.0]
    torch.save({"input_ids": ids, "loss_mask": loss_mask, "t_draws": draws[0], "token_draws": draws[1], "eps": 1e-3,
                "block_size": BLOCK_DIFF_BLOCK, "ar_loss_weight": 1.0, "loss_sum": total.float(), "count": count,
                "diffusion_sum": diffusion.float(), "masked_tokens": masked, "ar_sum": torch.tensor(ar_sum)},
               OUT / "expected_loss_block_diff.pt")
    print(f"block_diff: diffusion {float(diffusion):.6f} over {masked} masked, AR {ar_sum:.6f}, total {float(total):.6f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", type=Path, required=True,
                    help="a folder with the Hub's three .py files and its config.json")
    ap.add_argument("--block-diff-only", action="store_true",
                    help="only (re)make expected_loss_block_diff.pt from the fixture's weights")
    args = ap.parse_args()
    if not args.block_diff_only:
        run(args.reference)
    record_block_diff_loss(args.reference)
