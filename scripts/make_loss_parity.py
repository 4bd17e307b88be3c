#!/usr/bin/env python
"""Regenerate the loss-parity cases (tests/assets/loss_parity/*.pt) from the authors' code (docs/loss_parity.md).

Each case runs a method's PUBLISHED loss code -- imported from a local checkout of the authors' repository, with its
unused training-framework imports stubbed (loss_parity_lib.py) -- on small random inputs, and saves the inputs,
the dare config with the same hyperparameters, and the loss value and gradients w.r.t. the current-policy
log-probs. tests/algorithms/test_loss_parity.py then asserts that dare's own loss gives the same to 1e-6.

    python scripts/make_loss_parity.py --refs-root /path/to/checkouts            # every case
    python scripts/make_loss_parity.py --ref spg=/src/SPG --only spg_mix         # one case
    python scripts/make_loss_parity.py --list

A checkout is found as ``--ref KEY=PATH``, else ``<refs-root>/KEY``, ``<refs-root>/<name>`` or
``<refs-root>/<owner>+<name>``; its commit is read with git, or given with ``--commit KEY=SHA``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

import loss_parity_lib as lib  # noqa: E402
from tests.algorithms.parity_io import CASE_DIR, load_case, save_case  # noqa: E402


def _pairs(items: list[str], flag: str) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in lib.REPOS:
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE with KEY one of {', '.join(lib.REPOS)}")
        out[key] = value
    return out


def main(argv=None) -> int:
    lib.load_case_modules(Path(__file__).resolve().parent)  # every scripts/loss_parity_cases_*.py
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refs-root", type=Path, help="folder holding the reference checkouts")
    ap.add_argument("--ref", action="append", default=[], metavar="KEY=PATH", help="one reference checkout")
    ap.add_argument("--commit", action="append", default=[], metavar="KEY=SHA",
                    help="commit of a checkout that is not a git work tree")
    ap.add_argument("--only", action="append", default=[], metavar="CASE", help="regenerate these cases only")
    ap.add_argument("--out", type=Path, default=CASE_DIR)
    ap.add_argument("--list", action="store_true", help="list the cases and their reference repositories")
    args = ap.parse_args(argv)
    if args.list:
        for name, (key, _) in sorted(lib.CASES.items()):
            print(f"{name:24s} {lib.REPOS[key]}")
        return 0
    unknown = [n for n in args.only if n not in lib.CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; --list shows them")
    paths, commits = _pairs(args.ref, "--ref"), _pairs(args.commit, "--commit")
    refs: dict = {}
    for name in args.only or sorted(lib.CASES):
        key, fn = lib.CASES[name]
        if key not in refs:
            refs[key] = lib.find_reference(key, paths, args.refs_root, commits)
        case = fn(refs[key])
        previous = args.out / f"{name}.pt"
        if "doc" not in case and previous.is_file():  # keep the case's row of docs/loss_parity.md
            doc = load_case(previous).get("doc")
            case.update({"doc": doc} if doc else {})
        path = save_case(name, case, args.out)
        grads = ", ".join(f"{k} {tuple(v.shape)}" for k, v in case["expected"]["grad"].items())
        print(f"{name:24s} loss {float(case['expected']['loss']):+.6f}  grad {grads}  "
              f"{path.stat().st_size / 1024:.1f} KB  {case['reference']['repo']}@{case['reference']['commit'][:10]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
