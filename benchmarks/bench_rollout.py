"""Rollout engine speed: tokens/s and forward passes (NFE) of every decoding mode, measured side by side.

    .venv/bin/python benchmarks/bench_rollout.py --threads 1   # the table in benchmarks/rollout.md (~5 min)
    .venv/bin/python benchmarks/bench_rollout.py --quick       # smoke run (small models, short generations)

Masked model: ``tiny("llada", hidden 384, 6 layers, 6 heads, MLP 1024, vocab 1024)``. With the default
init (std 0.02) every prediction is near-uniform and threshold decoding falls back to one token per step,
so the benchmark model is made peaked: weights drawn with std 0.15 (like the "peaky" golden fixtures) and the
LM head scaled x3. Its confidences then depend on position and context and threshold 0.9 commits about 2-3
tokens per step, the parallelism Fast-dLLM reports for LLaDA on GSM8K. Block model: ``tiny("sdar")`` of the
same size with its default init (static schedule: peakedness does not matter).

Rows compare modes on the same prompts in one process; the ratios are what matter (other processes may share
the CPU, which moves absolute numbers; one intra-op thread keeps the ratios stable on a loaded machine).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from dare.models import tiny
from dare.rollout import SamplerConfig, generate


def peaked_llada(sizes: dict):
    model = tiny("llada", seed=0, std=0.15, **sizes)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def timed(model, prompts, cfg, repeats: int = 1):
    """(seconds, nfe, generated tokens) of the fastest of ``repeats`` runs."""
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = generate(model, prompts, cfg)
        dt = time.perf_counter() - t0
        if best is None or dt < best[0]:
            best = (dt, r.nfe, int(r.completion_ids.numel()), r)
    return best


def serial(model, prompts, cfg):
    t0 = time.perf_counter()
    nfe = tokens = 0
    for p in prompts:
        r = generate(model, [p], cfg)
        nfe += r.nfe
        tokens += int(r.completion_ids.numel())
    return time.perf_counter() - t0, nfe, tokens, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models and short generations (smoke run)")
    ap.add_argument("--gen-length", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    G = args.gen_length or (64 if args.quick else 256)
    sizes = dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256, vocab_size=1024) if args.quick else \
        dict(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1024, vocab_size=1024)
    gen = torch.Generator().manual_seed(1)
    lengths = [16, 20, 17, 24, 18, 22, 16, 19]
    prompts = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in lengths]
    one = prompts[:1]
    rows = []

    def add(name, res, ref=None):
        dt, nfe, tokens, _ = res
        rows.append((name, nfe, tokens, dt, tokens / dt, (ref[0] / dt) if ref else None))
        return res

    llada = peaked_llada(sizes)
    base = dict(gen_length=G, block_length=32, block_stop=False)
    vanilla = add("LLaDA vanilla (no cache, 1 token/step)", timed(llada, one, SamplerConfig(steps=G, **base)))
    add("LLaDA prefix cache", timed(llada, one, SamplerConfig(steps=G, cache="prefix", **base)), vanilla)
    add("LLaDA dual cache", timed(llada, one, SamplerConfig(steps=G, cache="dual", **base)), vanilla)
    add("LLaDA threshold 0.9 (no cache)", timed(llada, one, SamplerConfig(threshold=0.9, **base)), vanilla)
    add("LLaDA dual cache + threshold 0.9", timed(llada, one, SamplerConfig(threshold=0.9, cache="dual", **base), 2), vanilla)
    group = SamplerConfig(threshold=0.9, cache="dual", **base)
    ser = add("LLaDA dual + threshold: 8 prompts, 8 serial calls", serial(llada, prompts, group))
    add("LLaDA dual + threshold: 8 prompts, one batched call", timed(llada, prompts, group), ser)
    del llada

    sdar = tiny("sdar", seed=0, **sizes)
    block = dict(gen_length=G, block_length=4, steps_per_block=4, remasking="static", block_stop=False)
    none = add("SDAR block 4: recompute the prefix every step (cache=none)", timed(sdar, one, SamplerConfig(**block)))
    cached = SamplerConfig(cache="block", **block)
    add("SDAR block 4: exact block KV cache (cache=block)", timed(sdar, one, cached, 2), none)
    ser = add("SDAR block cache: 8 prompts, 8 serial calls", serial(sdar, prompts, cached))
    add("SDAR block cache: 8 prompts, one batched call", timed(sdar, prompts, cached), ser)

    threads = torch.get_num_threads()
    print(f"\nRollout benchmark: gen_length {G}; {sizes['num_layers']} layers x hidden {sizes['hidden_size']}, "
          f"{sizes['num_heads']} heads, MLP {sizes['intermediate_size']}, vocab {sizes['vocab_size']}; LLaDA block 32, "
          f"SDAR block 4; CPU, {threads} torch thread(s), load average {os.getloadavg()[0]:.1f} (other processes "
          f"share the CPU). Speed-up = seconds of the row's baseline / seconds of the row.\n")
    print("| mode | NFE | tokens | seconds | tokens/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, nfe, tokens, dt, tps, ratio in rows:
        print(f"| {name} | {nfe} | {tokens} | {dt:.2f} | {tps:.1f} | {'baseline' if ratio is None else f'{ratio:.1f}x'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
