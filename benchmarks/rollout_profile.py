"""Where the time of a decode goes, and how far it is from the machine's GEMM bound (used by bench_rollout.py).

``profile_decode`` times a decode without the profiler (the reference time), counts its FLOPs (every GEMM and the
attention), then profiles it once with labelled regions and attributes every tensor op's own time to a category:
GEMM, attention, KV-cache writes and other tensor ops inside the model forward; candidate selection and commits;
the sampler's bookkeeping. Whatever wall time no tensor op accounts for is interpreter and dispatch overhead.
``gemm_rates`` measures fp32 GEMM GFLOP/s in the same process: a 1024^3 product (what the core can do) and the
model's own projections at one decode step's shape.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

from dare.models import KVCache
from dare.models.model import DiffusionLM
from dare.rollout import generate, masked

# Tensor ops outside these regions are the sampler's bookkeeping (block progress, schedules, windows).
LABELS = {"forward": (DiffusionLM, "forward"), "cache write": (KVCache, "write"), "selection": (masked, "_decide")}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm"}


def _attention_flops(query, key, *args, out_shape=None, **kwargs) -> int:
    b, h, lq, d = query
    return 4 * b * h * lq * key[2] * d  # Q K^T and P V


@contextlib.contextmanager
def _labelled():
    """Wrap the functions of LABELS in profiler ranges for the duration of the block."""
    saved = []
    for label, (owner, name) in LABELS.items():
        fn = getattr(owner, name)

        def wrapped(*a, _fn=fn, _label=label, **kw):
            with record_function(f"dare::{_label}"):
                return _fn(*a, **kw)
        saved.append((owner, name, fn))
        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


@dataclass
class DecodeProfile:
    seconds: float  # median wall time without the profiler
    nfe: int
    tokens: int
    flops: int
    by_category: dict = field(default_factory=dict)  # category -> seconds of tensor-op time (profiled run)
    profiled_seconds: float = 0.0

    def print_tables(self, rates: dict) -> None:
        ops_total = sum(self.by_category.values())
        scale = self.seconds / self.profiled_seconds  # profiled times, rescaled to the unprofiled wall time
        rows = [(k, v * scale) for k, v in self.by_category.items()]
        rows.append(("Python, dispatch and allocation (wall time no tensor op accounts for)",
                     max(0.0, self.seconds - ops_total * scale)))
        print(f"{self.nfe} forwards, {self.tokens} tokens, {self.seconds:.2f} s ({self.seconds / self.nfe * 1e3:.2f} ms "
              f"per forward); shares from one profiled run, rescaled to the unprofiled time.\n")
        print("| where | ms per forward | share |")
        print("|---|---:|---:|")
        for name, sec in rows:
            print(f"| {name} | {sec / self.nfe * 1e3:.2f} | {100 * sec / self.seconds:.0f}% |")
        per_token = self.flops / self.tokens
        achieved = self.flops / self.seconds / 1e9
        peak, step = rates["1024^3"], rates["step"]
        print(f"\n| GEMM bound | value |\n|---|---:|")
        print(f"| FLOPs per generated token (counted: every GEMM and the attention) | {per_token / 1e6:.0f} MFLOP |")
        print(f"| fp32 GEMM, 1024 x 1024 x 1024 (same run) | {peak:.0f} GFLOP/s |")
        print(f"| fp32 GEMM at one step's shapes (the model's projections, {rates['rows']} rows) | {step:.0f} GFLOP/s |")
        print(f"| achieved by the decode | {achieved:.1f} GFLOP/s ({100 * achieved / peak:.0f}% of the 1024^3 rate, "
              f"{100 * achieved / step:.0f}% of the step-shape rate) |")
        print(f"| time if every FLOP ran at the step-shape GEMM rate | {self.flops / step / 1e9:.2f} s "
              f"({self.seconds / (self.flops / step / 1e9):.1f}x below the measured {self.seconds:.2f} s) |")


def _category(ev_name: str, region: str) -> str:
    if region == "forward":
        if ev_name in GEMM_OPS:
            return "model forward: GEMM (projections, LM head)"
        if "scaled_dot_product" in ev_name:
            return "model forward: attention (SDPA)"
        return "model forward: other tensor ops (norms, RoPE, embedding, SiLU, residuals)"
    if region == "cache write":
        return "model forward: KV-cache writes"
    if region == "selection":
        return "selection: candidates, confidences, threshold, commit"
    return "sampler bookkeeping (block progress, schedules, windows)"


def count_flops(fn) -> int:
    """FLOPs of every GEMM and the attention that ``fn()`` runs (counted, not timed)."""
    with FlopCounterMode(display=False, custom_mapping={
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}) as fc:
        fn()
    return fc.get_total_flops()


def profile_decode(model, prompts, cfg, repeats: int = 3) -> DecodeProfile:
    generate(model, prompts, cfg)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = generate(model, prompts, cfg)
        times.append(time.perf_counter() - t0)
    flops = count_flops(lambda: generate(model, prompts, cfg))
    prof = DecodeProfile(statistics.median(times), r.nfe, int(r.completion_ids.numel()), flops)
    with _labelled(), profile(activities=[ProfilerActivity.CPU]) as p:
        t0 = time.perf_counter()
        generate(model, prompts, cfg)
        prof.profiled_seconds = time.perf_counter() - t0
    for ev in p.events():
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent  # the nearest labelled range decides the region
        while parent is not None and not parent.name.startswith("dare::"):
            parent = parent.cpu_parent
        cat = _category(ev.name, parent.name[len("dare::"):] if parent is not None else "bookkeeping")
        prof.by_category[cat] = prof.by_category.get(cat, 0.0) + ev.self_cpu_time_total / 1e6
    return prof


def _rate(fn, flops: float, seconds: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return flops / best / 1e9


def gemm_rates(model, rows: int) -> dict:
    """fp32 GEMM GFLOP/s: a 1024^3 product, and the model's projections applied to ``rows`` tokens."""
    big = torch.randn(1024, 1024)
    peak = _rate(lambda: big @ big, 2 * 1024 ** 3)
    layer = model.model.layers[0]
    weights = [torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]),
               layer.self_attn.o_proj.weight, torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]),
               layer.mlp.down_proj.weight, model.lm_head.weight]
    xs = [torch.randn(rows, w.shape[1]) for w in weights]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)

    def step():
        for x, w in zip(xs, weights):
            F.linear(x, w)
    return {"1024^3": peak, "step": _rate(step, flops), "rows": rows}
