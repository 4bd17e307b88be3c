"""``dare algorithms [--matrix] [--json]``: the registered training methods and the families each runs on.

Everything comes from the registries (``dare.algorithms.ALGORITHMS`` and ``dare.models.FAMILIES``, see
``dare.algorithms.matrix``): a newly registered algorithm or family shows up without editing this file.
"""
from __future__ import annotations

import json

NAME = "algorithms"
HELP = "list registered training algorithms (kind, supported families, estimator, MC samples) or the support matrix"


def add_arguments(p):
    p.add_argument("--matrix", action="store_true",
                   help="print the Markdown algorithm x family support matrix (the README's table)")
    p.add_argument("--json", action="store_true", help="machine-readable list")
    p.add_argument("--write", metavar="FILE", default=None,
                   help="with --matrix: replace the table between the support-matrix markers of FILE (e.g. README.md)")


def table() -> str:
    """The algorithm list as a Markdown table."""
    from dare.algorithms.matrix import algorithm_infos, family_attention
    fams = family_attention()
    lines = ["| algorithm | kind | families | MC samples (default) | estimator |", "|---|---|---|---|---|"]
    for a in algorithm_infos():
        every = set(a.families) == set(fams)
        where = "all" if every else ", ".join(a.families) or "none"
        lines.append(f"| `{a.name}` | {a.kind} | {where} | {a.mc_samples} | {a.summary} |")
    return "\n".join(lines)


def run(args) -> int:
    from dataclasses import asdict

    from pathlib import Path

    from dare.algorithms.matrix import algorithm_infos, markdown_matrix, with_matrix
    if args.write and not args.matrix:
        raise ValueError("--write needs --matrix")
    if args.write:
        path = Path(args.write)
        if not path.is_file():
            raise FileNotFoundError(f"--write: no such file: {path}")
        path.write_text(with_matrix(path.read_text(encoding="utf-8"), str(path)), encoding="utf-8")
        print(f"updated the support matrix in {path}")
    elif args.matrix:
        print(markdown_matrix())
    elif args.json:
        print(json.dumps([asdict(a) for a in algorithm_infos()], indent=1))
    else:
        print(table())
    return 0
