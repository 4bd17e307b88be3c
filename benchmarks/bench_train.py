"""Training-executor benchmarks, measured side by side in one run and printed as a Markdown table.

    .venv/bin/python benchmarks/bench_train.py            # full sizes (a few minutes on 2 CPU cores)
    .venv/bin/python benchmarks/bench_train.py --quick    # smaller sizes (smoke run)

1. SFT step time, packed vs padded rows, on a length-skewed batch (many short documents, a few long ones): the same
   documents, the same noise (keyed per document), the same code path (``stages.prepare`` + ``stages.update``).
2. Peak memory of the loss + backward with chunked linear + log-softmax at the target rows versus full-vocabulary
   logits over the whole sequence, each variant in a fresh subprocess (peak RSS above the same baseline).
3. Tokens/s of an SFT epoch of a tiny model through ``Trainer`` (toy data), packed and padded.
4. Spread of the DPO margin s over noise draws: naive (1 sample, independent noise for the reference) versus VRPO
   (8 samples, stratified, antithetic), at the same policy and reference.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------------------------------------
# 1. packed vs padded
# ----------------------------------------------------------------------------------------------------------
def bench_packing(quick: bool) -> dict:
    from dare.algorithms import StepContext, build_algorithm
    from dare.algorithms.sft import SFTConfig
    from dare.models import tiny, tiny_tokenizer
    from dare.trainer import stages
    from dare.trainer.data import SFTDoc, pack_first_fit, sft_rows_batch

    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, hidden_size=128, num_layers=4 if not quick else 2, num_heads=4, intermediate_size=256)
    g = torch.Generator().manual_seed(0)
    cap = 512 if not quick else 256
    n_short, n_long = (28, 4) if not quick else (14, 2)
    docs = []
    for i in range(n_short + n_long):
        n = int(torch.randint(16, 64, (1,), generator=g)) if i < n_short else int(torch.randint(cap - 112, cap, (1,), generator=g))
        p = max(4, n // 4)
        docs.append(SFTDoc(i, torch.randint(10, 100, (p,), generator=g).tolist(), torch.randint(10, 100, (n - p,), generator=g).tolist()))
    perm = torch.randperm(len(docs), generator=g).tolist()
    docs = [docs[i] for i in perm]
    algo = build_algorithm(SFTConfig())
    micro = 4
    out = {}
    for name, rows in (("padded", [[d] for d in docs]), ("packed", pack_first_fit(docs, cap))):
        batch = sft_rows_batch(rows, list(range(len(rows))), tok.eos_token_id, pad_in_loss=False)
        times = []
        for rep in range(4 if not quick else 2):
            ctx = StepContext(step=0, seed=0, adapter=model.adapter)
            t0 = time.perf_counter()
            stages.prepare(algo, ctx, batch, model)
            ctx.norms = algo.normalizers(batch)
            m = stages.update(algo, ctx, model, batch, 0, micro)
            model.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
        out[name] = {"rows": len(rows), "tokens": int(batch["input_ids"].numel()),
                     "real_tokens": sum(len(d) for d in docs), "step_s": statistics.median(times[1:]), "loss": m["loss"]}
    out["speedup"] = out["padded"]["step_s"] / out["packed"]["step_s"]
    return out


# ----------------------------------------------------------------------------------------------------------
# 2. chunked vs full-vocabulary logits (peak memory, one subprocess per variant)
# ----------------------------------------------------------------------------------------------------------
MEM_CHILD = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from dare.models import tiny
from dare.diffusion import score_targets
variant, V, L, B, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = tiny("llada", vocab_size=V, hidden_size=256, num_layers=2, num_heads=4, intermediate_size=512, mask_token_id=V - 1)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, V - 2, (B, L), generator=g)
targets = torch.zeros(B, L, dtype=torch.bool); targets[:, L // 4:] = True  # the answer part
labels = torch.randint(0, V - 2, (B, L), generator=g)
inp = torch.where(targets, torch.full_like(ids, V - 1), ids)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if variant == "full":
    logits = model(inp).logits.float()
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    loss = -(logp * targets).sum() / targets.sum()
elif variant == "chunked":
    logp, _ = score_targets(model, inp, targets, labels, chunk_size=chunk)
    loss = -logp.sum() / targets.sum()
if variant != "baseline":
    loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"base_kb": base, "peak_kb": peak, "loss": float(loss) if variant != "baseline" else None}}))
"""


def bench_memory(quick: bool) -> dict:
    V, L, B, chunk = (65536, 512, 4, 256) if not quick else (16384, 256, 2, 256)
    script = MEM_CHILD.format(root=str(ROOT / "src"))
    out = {"vocab": V, "seq": L, "batch": B, "chunk": chunk, "targets": B * (L - L // 4)}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for variant in ("baseline", "full", "chunked"):
        res = subprocess.run([sys.executable, "-c", script, variant, str(V), str(L), str(B), str(chunk)],
                             capture_output=True, text=True, env=env, check=True)
        out[variant] = json.loads(res.stdout.strip().splitlines()[-1])
    for variant in ("full", "chunked"):
        out[variant]["extra_mb"] = (out[variant]["peak_kb"] - out["baseline"]["peak_kb"]) / 1024
    out["ratio"] = out["full"]["extra_mb"] / max(out["chunked"]["extra_mb"], 1e-6)
    out["loss_diff"] = abs(out["full"]["loss"] - out["chunked"]["loss"])
    return out


# ----------------------------------------------------------------------------------------------------------
# 3. SFT epoch tokens/s
# ----------------------------------------------------------------------------------------------------------
def bench_epoch(quick: bool) -> dict:
    from dare.trainer.recipe import load_recipe
    from dare.trainer.loop import Trainer

    out = {}
    for packing in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            steps = 8 if not quick else 4
            recipe = load_recipe(ROOT / "recipes/sft_tiny.yaml", [
                f"data.pairs={ROOT / 'tests/assets/data/toy_sft.jsonl'}", f"train.output_dir={tmp}", f"train.steps={steps}",
                "train.batch_size=16", "train.micro_batch_size=4", "train.save_every=0", "train.export=false",
                f"data.packing={str(packing).lower()}", "data.loss_on_padding=false", "logging.progress=false",
                "logging.tensorboard=false", "logging.plot=false"])
            trainer = Trainer(recipe)
            real = sum(int((trainer.source.batch(s)["doc_uid"] >= 0).sum()) for s in range(steps))
            t0 = time.perf_counter()
            trainer.run()
            dt = time.perf_counter() - t0
            out["packed" if packing else "padded"] = {"docs": steps * 16, "real_tokens": real, "seconds": dt,
                                                       "tokens_per_s": real / dt}
    return out


# ----------------------------------------------------------------------------------------------------------
# 4. DPO margin spread: naive vs VRPO
# ----------------------------------------------------------------------------------------------------------
def bench_vrpo(quick: bool) -> dict:
    from dare.algorithms import StepContext, build_algorithm
    from dare.algorithms.dpo import DPOConfig, VRPOConfig
    from dare.trainer.recipe import DataSection
    from dare.models import tiny, tiny_tokenizer
    from dare.trainer import stages
    from dare.trainer.data import PreferenceSource, load_preference_pairs
    from dare.trainer.reference import CopyReference

    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, hidden_size=64, num_layers=2, seed=1)
    ref = CopyReference.from_policy(model)
    with torch.no_grad():  # a policy slightly away from the reference, as during training
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    pairs = load_preference_pairs(DataSection(pairs=str(ROOT / "tests/assets/data/toy_pref.jsonl"), max_length=64), tok)
    out = {}
    draws = 12 if not quick else 4
    for name, cfg in (("dpo_naive", DPOConfig(mc_samples=1, antithetic=False)),
                      ("vrpo", VRPOConfig(mc_samples=8))):
        algo = build_algorithm(cfg)
        margins = []
        for k in range(draws):
            batch = PreferenceSource(pairs, 8, seed=0, pad_id=tok.eos_token_id).batch(0)
            ctx = StepContext(step=k, seed=0, adapter=model.adapter)
            stages.prepare(algo, ctx, batch, model, ref)
            with torch.no_grad():
                cur = algo.log_likelihood(ctx, model, batch, batch.views[0])
            margins.append(algo.margin(batch, cur.value, 0))
        m = torch.stack(margins)  # [draws, pairs]
        out[name] = {"std_over_draws": float(m.std(0).mean()), "mean": float(m.mean()), "forwards_per_pair": 2 * cfg.mc_samples * (2 if not cfg.antithetic else 1)}
    out["std_ratio"] = out["dpo_naive"]["std_over_draws"] / out["vrpo"]["std_over_draws"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the raw numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {"packing": bench_packing(args.quick), "memory": bench_memory(args.quick), "epoch": bench_epoch(args.quick),
               "vrpo": bench_vrpo(args.quick)}
    p, m, e, v = results["packing"], results["memory"], results["epoch"], results["vrpo"]
    print("| benchmark | baseline | dare | ratio |")
    print("|---|---|---|---|")
    print(f"| SFT step, length-skewed batch ({p['padded']['real_tokens']} real tokens) | padded: {p['padded']['rows']} rows, "
          f"{p['padded']['tokens']} tokens, {p['padded']['step_s']:.3f} s | packed: {p['packed']['rows']} rows, "
          f"{p['packed']['tokens']} tokens, {p['packed']['step_s']:.3f} s | {p['speedup']:.2f}x faster |")
    print(f"| loss + backward peak memory (vocab {m['vocab']}, {m['batch']}x{m['seq']} tokens, {m['targets']} targets) | "
          f"full-vocab logits: +{m['full']['extra_mb']:.0f} MB | chunked ({m['chunk']} rows): +{m['chunked']['extra_mb']:.0f} MB | "
          f"{m['ratio']:.1f}x less (loss diff {m['loss_diff']:.1e}) |")
    print(f"| SFT epoch tokens/s (tiny model, {e['packed']['docs']} docs) | padded: {e['padded']['tokens_per_s']:.0f} tok/s | "
          f"packed: {e['packed']['tokens_per_s']:.0f} tok/s | {e['packed']['tokens_per_s'] / e['padded']['tokens_per_s']:.2f}x |")
    print(f"| DPO margin std over noise draws (8 pairs) | naive 1-sample, independent noise: {v['dpo_naive']['std_over_draws']:.3f} | "
          f"VRPO n=8 antithetic: {v['vrpo']['std_over_draws']:.3f} | {v['std_ratio']:.1f}x lower |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
