"""Runs NVlabs/Fast-dLLM's own LLaDA samplers for ``bench_rollout.py``, in the Python environment they need.

Not part of dare and never imported by it: ``bench_rollout.py --reference CHECKOUT --reference-python PYTHON``
starts this script with the reference's interpreter (transformers 4.49, einops) and talks to it over stdin/stdout,
one JSON object per line, so both sides are timed in the same run, interleaved:

    request:  {"fn": "generate_with_dual_cache", "prompt": [...], "steps": 256, "gen_length": 256,
               "block_length": 32, "threshold": 0.9, "threads": 1}
    answer:   {"seconds": ..., "nfe": ..., "completion": [...]}

The checkout's ``llada/generate.py`` and ``llada/model/modeling_llada.py`` are imported as they are.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkout", required=True, help="local clone of NVlabs/Fast-dLLM")
    ap.add_argument("--model", required=True, help="LLaDA checkpoint folder (published layout)")
    ap.add_argument("--mask-id", type=int, required=True)
    args = ap.parse_args()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # anything the reference prints must not reach the protocol stream
    sys.path.insert(0, os.path.join(args.checkout, "llada"))
    import torch
    import transformers
    import generate as reference  # llada/generate.py of the checkout
    from model.modeling_llada import LLaDAModelLM

    model = LLaDAModelLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    out.write(json.dumps({"ready": True, "torch": torch.__version__, "transformers": transformers.__version__}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        torch.set_num_threads(int(req.get("threads", 1)))
        fn = getattr(reference, req["fn"])
        prompt = torch.tensor([req["prompt"]], dtype=torch.long)
        t0 = time.perf_counter()
        x, nfe = fn(model, prompt, steps=req["steps"], gen_length=req["gen_length"], block_length=req["block_length"],
                    temperature=0.0, remasking="low_confidence", mask_id=args.mask_id, threshold=req.get("threshold"))
        seconds = time.perf_counter() - t0
        out.write(json.dumps({"seconds": seconds, "nfe": int(nfe), "completion": x[0, prompt.shape[1]:].tolist()}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
