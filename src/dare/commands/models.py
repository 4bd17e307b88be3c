"""``dare models [PATH ...]``: list supported families, or load checkpoints and describe them."""
from __future__ import annotations

import json
import time

NAME = "models"
HELP = "list supported model families, or load checkpoint folders / hub ids and describe them"


def add_arguments(p):
    p.add_argument("paths", nargs="*", help="checkpoint folders or Hugging Face ids")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask id for configs that carry none")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    import torch

    from dare.models import FAMILIES, load_model

    if not args.paths:
        width = max(len(name) for name in FAMILIES)
        for fam in FAMILIES.values():
            print(f"{fam.name:{width}s}  {fam.description}")
        return 0
    for path in args.paths:
        t0 = time.time()
        model = load_model(path, dtype=args.dtype, mask_token_id=args.mask_token_id)
        load_s = time.time() - t0
        ids = torch.randint(0, model.arch.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
        t0 = time.time()
        with torch.no_grad():
            logits = model(ids).logits
        info = {
            "path": str(path), "family": model.family, "params": sum(p.numel() for p in model.parameters()),
            "dtype": str(model.dtype).replace("torch.", ""), "layers": model.arch.num_layers,
            "hidden": model.arch.hidden_size, "moe": model.arch.moe is not None,
            "mask_token_id": model.adapter.mask_token_id, "eos_token_id": model.adapter.eos_token_id,
            "attention": model.adapter.attention, "block_size": model.adapter.block_size,
            "shift_logits": model.adapter.shift_logits, "load_s": round(load_s, 3),
            "forward_ms": round(1000 * (time.time() - t0), 2), "logits_shape": list(logits.shape),
        }
        print(json.dumps(info) if args.json else "  ".join(f"{k}={v}" for k, v in info.items()))
    return 0
