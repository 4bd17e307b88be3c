"""Rollout speed, measured side by side in one run and printed as Markdown tables (benchmarks/rollout.md).

    .venv/bin/python benchmarks/bench_rollout.py                                  # ours only (~15 min)
    .venv/bin/python benchmarks/bench_rollout.py --reference /work/refsrc/Fast-dLLM \\
        --reference-python /work/refenv/bin/python                                # also NVlabs/Fast-dLLM's own code
    .venv/bin/python benchmarks/bench_rollout.py --quick                          # smoke run (~1 min; a slow test runs it)

1. **single**: one 64-token prompt, gen 256, block 32, steps 256, low-confidence remasking, greedy, on an LLaDA-layout
   checkpoint (4 layers, hidden 256, 4 heads, MLP 768, vocabulary 2048; random "peaked" weights, written in the
   published LLaDA layout to a temporary folder and loaded by both sides): vanilla, prefix cache, dual cache,
   threshold 0.9, dual cache + threshold 0.9, and the cached modes again with ``SamplerConfig.compile`` (compiled
   once before timing), at each ``--threads`` count. With ``--reference`` the same modes run
   through Fast-dLLM's ``generate`` / ``generate_with_prefix_cache`` / ``generate_with_dual_cache`` in a second
   process (the reference needs transformers 4.49: ``--reference-python`` is the interpreter of an environment that
   runs it, kept outside this repository), interleaved with ours; every completion is compared token for token.
2. **group**: 8 prompts x 8 samples = 64 rows (temperature ``--group-temperature``, one seed per row), decoded in one
   batched call and in 64 serial calls, interleaved; LLaDA dual cache + threshold 0.9, and SDAR (block 4, 4 steps
   per block, exact block cache) of the same size; the LLaDA group again with ``compile``. Every row must equal its
   serial decode.
3. **profile**: where the time of one dual cache + threshold decode goes (model forward split into GEMM, attention,
   cache writes and other tensor ops; selection; bookkeeping; Python), and its distance to the GEMM bound: FLOPs per
   generated token (counted) against fp32 GEMM GFLOP/s measured in the same run.

Ratios are medians over ``--repeats`` interleaved repetitions: the machine may be shared, which moves absolute
times between repetitions far more than between the two sides of one repetition.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as dare's CLI: before torch starts its OpenMP pool

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_profile import count_flops, gemm_rates, profile_decode  # noqa: E402

from dare.models import load_model, tiny  # noqa: E402
from dare.models.lean import compile_problem  # noqa: E402
from dare.rollout import SamplerConfig, generate  # noqa: E402

MASK_ID = 500
MODES = [  # (name, reference function, our cache, threshold, SamplerConfig.compile)
    ("vanilla", "generate", "none", None, False),
    ("prefix cache", "generate_with_prefix_cache", "prefix", None, False),
    ("dual cache", "generate_with_dual_cache", "dual", None, False),
    ("threshold 0.9", "generate", "none", 0.9, False),
    ("dual cache + threshold 0.9", "generate_with_dual_cache", "dual", 0.9, False),
    # opt-in compiled cached steps (dare.models.lean): same reference, judged by the same token comparison
    ("prefix cache, compiled", "generate_with_prefix_cache", "prefix", None, True),
    ("dual cache, compiled", "generate_with_dual_cache", "dual", None, True),
    ("dual cache + threshold 0.9, compiled", "generate_with_dual_cache", "dual", 0.9, True),
]


def single_modes(quick: bool, compiles: bool) -> list[tuple]:
    """The modes a run times: the compiled ones only where torch.compile builds kernels, and in a --quick smoke run
    only the last of them (each compiled mode is a compile of its own, ~15 s on a cold cache; the compiled group
    reuses this one's graph, and tests/rollout/test_compiled_step.py holds the compiled prefix and dual cache steps
    to the reference tokens)."""
    compiled = [m for m in MODES if m[4]]
    keep = (compiled[-1:] if quick else compiled) if compiles else []
    return [m for m in MODES if not m[4] or m in keep]


def llada_checkpoint(folder: Path, sizes: dict) -> Path:
    """A random LLaDA of the given sizes in the published layout. Weights std 0.15 and the LM head x3 make the
    predictions peaked, so threshold decoding commits several tokens per step; the mask token's head row is zero,
    so no greedy decode ever predicts it (the reference would then loop on a block that cannot finish)."""
    model = tiny("llada", seed=0, std=0.15, **sizes)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        model.lm_head.weight[MASK_ID] = 0.0
    model.save_pretrained(folder)
    return folder


class Reference:
    """Fast-dLLM's samplers in a second process (benchmarks/fastdllm_reference.py), one request at a time."""

    def __init__(self, checkout: str, python: str, model_dir: Path):
        script = Path(__file__).resolve().parent / "fastdllm_reference.py"
        self.proc = subprocess.Popen([python, str(script), "--checkout", checkout, "--model", str(model_dir),
                                      "--mask-id", str(MASK_ID)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=dict(os.environ))
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the reference process did not start ({python} {script}); run it by hand to see why")
        self.versions = json.loads(hello)

    def run(self, fn: str, prompt: list[int], threads: int, **kw) -> dict:
        self.proc.stdin.write(json.dumps(dict(fn=fn, prompt=prompt, threads=threads, **kw)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the reference process died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def ours(model, prompts, cfg, threads: int, **kw):
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    r = generate(model, prompts, cfg, **kw)
    return time.perf_counter() - t0, r


def bench_single(model, ref, prompt, G, BL, threads_list, repeats, quick=False) -> list[dict]:
    rows = []
    if compile_problem() is not None:
        print(f"  compiled modes: skipped, torch.compile cannot build kernels here: {compile_problem()}",
              file=sys.stderr)
    for name, fn, cache, thr, compiled in single_modes(quick, compile_problem() is None):
        cfg = SamplerConfig(gen_length=G, block_length=BL, steps=G, cache=cache, threshold=thr, block_stop=False,
                            compile=compiled)
        row = dict(mode=name, threads={})
        if compiled:  # compiling is a one-off per shape, not part of a decode's time
            ours(model, [prompt], cfg, threads_list[0])
        for threads in threads_list:
            mine, theirs = [], []
            for rep in range(repeats):
                order = (0, 1) if rep % 2 == 0 else (1, 0)  # alternate who goes first
                for side in order:
                    if side == 0:
                        dt, r = ours(model, [prompt], cfg, threads)
                        mine.append(dt)
                        row["nfe"], row["completion"] = r.nfe, r.completion_ids[0].tolist()
                    elif ref is not None:
                        out = ref.run(fn, prompt, threads, steps=G, gen_length=G, block_length=BL, threshold=thr)
                        theirs.append(out["seconds"])
                        row["ref_nfe"], row["ref_completion"] = out["nfe"], out["completion"]
            ratios = [t / m for t, m in zip(theirs, mine)]
            row["threads"][threads] = dict(ours=statistics.median(mine), ref=statistics.median(theirs) if theirs else None,
                                           ratio=statistics.median(ratios) if ratios else None)
            print(f"  {name}, {threads} thread(s): ours {row['threads'][threads]['ours']:.2f} s"
                  + (f", reference {row['threads'][threads]['ref']:.2f} s, {row['threads'][threads]['ratio']:.2f}x"
                     if ratios else ""), file=sys.stderr, flush=True)
        row["identical"] = row.get("ref_completion") == row["completion"] if ref is not None else None
        rows.append(row)
    return rows


def bench_group(name, model, prompts, cfg, seeds, repeats, threads) -> dict:
    """One batched call over all rows vs one call per row (same seeds: row i of the batch is serial call i).

    Also the ceiling on the speed-up this machine allows: the batched call cannot take less than its FLOPs
    (counted) at the best fp32 GEMM rate measured in the same run (a 1024^3 product or the model's projections at
    the batched step's rows), so no batching of the same work beats serial seconds / that floor."""
    batched, serial, ratios, identical = [], [], [], True
    nfe_serial = 0
    for rep in range(repeats):
        dt_b, r = ours(model, prompts, cfg, threads, seeds=seeds)
        t0 = time.perf_counter()
        nfe_serial = 0
        for i, p in enumerate(prompts):
            _, one = ours(model, [p], cfg, threads, seeds=[seeds[i]])
            nfe_serial += one.nfe
            identical &= torch.equal(one.completion_ids[0], r.completion_ids[i])
        dt_s = time.perf_counter() - t0
        batched.append(dt_b)
        serial.append(dt_s)
        ratios.append(dt_s / dt_b)
        print(f"  {name}: batched {dt_b:.1f} s, serial {dt_s:.1f} s ({dt_s / dt_b:.2f}x)", file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    flops = count_flops(lambda: generate(model, prompts, cfg, seeds=seeds))
    rates = gemm_rates(model, len(prompts) * cfg.block_length)
    floor = flops / max(rates["1024^3"], rates["step"]) / 1e9
    return dict(name=name, rows=len(prompts), nfe_batched=r.nfe, nfe_serial=nfe_serial, batched=statistics.median(batched),
                serial=statistics.median(serial), ratio=statistics.median(ratios), identical=identical,
                tokens=int(r.completion_ids.numel()), flops=flops, rates=rates, floor=floor,
                ceiling=statistics.median(serial) / floor)


def print_single(rows, threads_list, ref, load) -> None:
    if ref is not None:
        print(f"Reference: NVlabs/Fast-dLLM `llada/generate.py` + `modeling_llada.py` (torch {ref.versions['torch']}, "
              f"transformers {ref.versions['transformers']}); ours: torch {torch.__version__}. Load average at the start "
              f"{load:.1f}. Ratio = reference seconds / our seconds, median of interleaved repetitions.\n")
    head = "| mode | NFE ours | NFE ref | same tokens |" + "".join(
        f" ours s ({t} thr) | ref s ({t} thr) | ratio ({t} thr) |" for t in threads_list)
    print(head)
    print("|---|---:|---:|:---:|" + "---:|---:|---:|" * len(threads_list))
    for r in rows:
        cells = [r["mode"], str(r["nfe"]), str(r.get("ref_nfe", "-")),
                 "-" if r["identical"] is None else ("yes" if r["identical"] else "**no**")]
        for t in threads_list:
            c = r["threads"][t]
            cells += [f"{c['ours']:.2f}", "-" if c["ref"] is None else f"{c['ref']:.2f}",
                      "-" if c["ratio"] is None else f"**{c['ratio']:.2f}x**"]
        print("| " + " | ".join(cells) + " |")


def print_group(rows) -> None:
    print("| group (64 rows) | NFE batched | NFE serial (sum) | batched s | 64 serial calls s | speed-up | rows equal serial |"
          " batched GFLOP (counted) | floor s at best GEMM rate | ceiling (serial s / floor) |")
    print("|---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|")
    for g in rows:
        print(f"| {g['name']} | {g['nfe_batched']} | {g['nfe_serial']} | {g['batched']:.1f} | {g['serial']:.1f} | "
              f"**{g['ratio']:.2f}x** | {'yes' if g['identical'] else '**no**'} | {g['flops'] / 1e9:.0f} | "
              f"{g['floor']:.1f} | {g['ceiling']:.1f}x |")
    for g in rows:
        r = g["rates"]
        print(f"\n{g['name']}: fp32 GEMM {r['1024^3']:.0f} GFLOP/s at 1024^3, {r['step']:.0f} GFLOP/s at the model's "
              f"projections over {r['rows']} rows (same run); the floor uses the larger.", end="")
    print()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small model, short generations, one repetition, one compiled single mode (smoke run)")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts for the single-prompt modes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sections", default="single,group,profile")
    ap.add_argument("--reference", help="local checkout of NVlabs/Fast-dLLM (times its LLaDA samplers side by side)")
    ap.add_argument("--reference-python", help="python of an environment that runs the reference (transformers 4.49)")
    ap.add_argument("--group-temperature", type=float, default=1.0)
    ap.add_argument("--group-repeats", type=int, default=2)
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    threads_list = [int(t) for t in args.threads.split(",")]
    repeats = 1 if args.quick else args.repeats
    G, BL = (64, 32) if args.quick else (256, 32)
    sizes = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=160, vocab_size=512) if args.quick else \
        dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=768, vocab_size=2048)
    gen = torch.Generator().manual_seed(1)
    P = 16 if args.quick else 64
    prompt = torch.randint(10, sizes["vocab_size"] - 10, (P,), generator=gen).tolist()
    while MASK_ID in prompt:
        prompt.remove(MASK_ID)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dare-bench-llada-") as tmp:
        model = load_model(llada_checkpoint(Path(tmp), sizes))
        if "single" in sections:
            ref = None
            if args.reference:
                if not args.reference_python:
                    ap.error("--reference needs --reference-python (an environment with transformers 4.49)")
                ref = Reference(args.reference, args.reference_python, Path(tmp))
            print("## single sequence", file=sys.stderr)
            rows = bench_single(model, ref, prompt, G, BL, threads_list, repeats, args.quick)
            print(f"\n### Single sequence: {P}-token prompt, gen {G}, block {BL}, steps {G}, low-confidence, greedy\n")
            print_single(rows, threads_list, ref, load)
            if ref is not None:
                ref.close()
        if "group" in sections:
            print("## group", file=sys.stderr)
            n_prompts, n_samples = (2, 2) if args.quick else (8, 8)
            texts = [torch.randint(10, sizes["vocab_size"] - 10, (P,), generator=gen).tolist() for _ in range(n_prompts)]
            texts = [[t if t != MASK_ID else MASK_ID + 1 for t in p] for p in texts]
            prompts = [p for p in texts for _ in range(n_samples)]
            seeds = list(range(1000, 1000 + len(prompts)))
            grp_repeats = 1 if args.quick else args.group_repeats
            temp = args.group_temperature
            llada_cfg = SamplerConfig(gen_length=G, block_length=BL, threshold=0.9, cache="dual", temperature=temp,
                                      block_stop=False)
            sdar = tiny("sdar", seed=0, **sizes)
            sdar_cfg = SamplerConfig(gen_length=G, block_length=4, steps_per_block=4, remasking="static", cache="block",
                                     temperature=temp, block_stop=False)
            groups = [bench_group("LLaDA, dual cache + threshold 0.9", model, prompts, llada_cfg, seeds, grp_repeats, 1)]
            if compile_problem() is None:
                compiled_cfg = dataclasses.replace(llada_cfg, compile=True)
                for batch in ([prompts[0]], prompts):  # compile both shapes before timing
                    ours(model, batch, compiled_cfg, 1, seeds=seeds[:len(batch)])
                groups.append(bench_group("LLaDA, dual cache + threshold 0.9, compiled", model, prompts, compiled_cfg,
                                          seeds, grp_repeats, 1))
            groups.append(bench_group("SDAR, block 4, exact block cache", sdar, prompts, sdar_cfg, seeds, grp_repeats, 1))
            print(f"\n### Groups: {n_prompts} prompts x {n_samples} samples ({P}-token prompts, gen {G}, temperature "
                  f"{temp}, 1 thread)\n")
            print_group(groups)
        if "profile" in sections:
            print("## profile", file=sys.stderr)
            cfg = SamplerConfig(gen_length=G, block_length=BL, steps=G, cache="dual", threshold=0.9, block_stop=False)
            torch.set_num_threads(1)
            prof = profile_decode(model, [prompt], cfg, repeats)
            rates = gemm_rates(model, BL)
            print(f"\n### Where the time goes: dual cache + threshold 0.9, one prompt, 1 thread\n")
            prof.print_tables(rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
