"""One prepared check of dare on whatever accelerator a machine has: every CUDA path's correctness, the attention
backends against each other, speed at full shape, and the plan against the real step (benchmarks/gpu.md).

    PYTHONPATH=src python benchmarks/gpu_check.py --out DIR                        # a GPU machine, nothing installed
    PYTHONPATH=src python benchmarks/gpu_check.py --quick --device cpu --out DIR   # every part at tiny shapes (a test)
    PYTHONPATH=src python benchmarks/gpu_check.py --parts correctness,backends --out DIR

Standard library, torch, transformers, safetensors and pyyaml only (what a lent GPU machine has; no pytest, no
download: full-size models are built from the configs dare ships, with random weights). Writes DIR/gpu_check.md (one
table per part) and DIR/gpu_check.json (every number). Each part is timed and runs on its own: one that cannot run
says why in one line (a missing package, too little memory), one that fails records its error, and the next part
runs either way. The exit status is 1 when a correctness or backend check disagrees beyond its tolerance or a part
failed, else 0.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/rollout/fixture_cases.py: the fixtures' reference decodes, as the tests read them
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_parts  # noqa: E402  (the parts; this file runs them and writes the report)

PARTS = ("correctness", "backends", "speed", "plan")


def device_info(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                    cuda=torch.version.cuda)
    else:
        info.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def run_part(name: str, ctx: "gpu_parts.Context") -> dict:
    start = time.perf_counter()
    out = {"part": name, "status": "ok", "rows": [], "reason": None}
    try:
        out["rows"] = getattr(gpu_parts, name)(ctx)
    except gpu_parts.Skip as e:
        out.update(status="skipped", reason=str(e))
    except Exception as e:  # a failing part is a finding: recorded, and the next part runs
        out.update(status="error", reason=f"{type(e).__name__}: {e}".splitlines()[0][:300],
                   traceback=traceback.format_exc(limit=8))
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    out["seconds"] = round(time.perf_counter() - start, 1)
    bad = [r for r in out["rows"] if r.get("ok") is False]
    if out["status"] == "ok" and bad:
        out["status"] = "disagrees"
    return out


def markdown(info: dict, results: list[dict], quick: bool) -> str:
    lines = [f"# dare GPU check{' (quick, tiny shapes)' if quick else ''}", "",
             " | ".join(f"{k}: {v}" for k, v in info.items() if v is not None), ""]
    for r in results:
        lines += [f"## {r['part']}: {r['status']} ({r['seconds']} s)", ""]
        if r["reason"]:
            lines += [r["reason"], ""]
        rows = r["rows"]
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))
            lines.append("| " + " | ".join(keys) + " |")
            lines.append("|" + "---|" * len(keys))
            for row in rows:
                lines.append("| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
            lines.append("")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v).replace("|", "/")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_check.md and gpu_check.json")
    ap.add_argument("--device", default=None, help="cuda (default when one is visible) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and a subset of the fixture decodes")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = gpu_parts.Context(device=device, quick=args.quick)
    info = device_info(device)
    print(f"dare GPU check on {info.get('name')} ({device}), parts: {', '.join(parts)}", flush=True)
    results = []
    for name in parts:
        print(f"== {name}", flush=True)
        results.append(run_part(name, ctx))
        r = results[-1]
        print(f"   {r['status']} in {r['seconds']} s" + (f": {r['reason']}" if r["reason"] else ""), flush=True)
        # written after every part: a run stopped by its time limit keeps what it measured
        (out / "gpu_check.json").write_text(json.dumps({"info": info, "quick": args.quick, "results": results},
                                                       indent=1, default=str))
        (out / "gpu_check.md").write_text(markdown(info, results, args.quick))
    print((out / "gpu_check.md").read_text())
    return 1 if any(r["status"] in ("error", "disagrees") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
