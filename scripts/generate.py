"""Regenerate every generated artifact of the repository from its source, or check that none is stale.

    python scripts/generate.py            # rewrite every stale artifact
    python scripts/generate.py --check    # exit 1 naming each stale file (tests/test_generate.py runs this)
    python scripts/generate.py --only matrix comparison    # some of them

The artifacts (name: files <- source):

- matrix: README.md's algorithm x family support matrix (between the support-matrix markers) <- the algorithm and
  family registries (``dare.algorithms.matrix``; ``dare algorithms --matrix`` prints the same table);
- paper-recipes: recipes/paper/** <- scripts/make_paper_recipes.py (the registry's RL methods x models x tasks), each
  header with its planned peak from docs/plan_recipes.json;
- paper-grid: the grid table of docs/paper_recipes.md (between the paper-grid markers) <- the same grid
  (``make_paper_recipes.grid_table``);
- paper-settings: the paragraph between the paper-settings markers of docs/algorithms/<name>.md <- the method's
  ``paper`` (``paper_markdown``) and the comparison's documented departure for it (``dare.comparison.departures``);
- plans: docs/plan_recipes.md and the "Expected resources (full size)" section of docs/paper_recipes.md <-
  docs/plan_recipes.json, without planning (``python scripts/plan_recipes.py`` plans, about an hour);
- comparison: docs/comparison_table.md, the table between the comparison-table markers of docs/comparison.md and the
  verdicts' paragraph between the comparison-summary markers of docs/comparison.md and README.md <-
  docs/comparison.json, the comparison's stored data (``dare compare --docs docs`` writes it from its runs), and the
  methods with a documented lr factor;
- loss-parity: the table of cases in docs/loss_parity.md (between the loss-parity-cases markers) <- the case files
  tests/assets/loss_parity/*.pt (their reference and ``doc``; ``tests.algorithms.parity_io.cases_markdown``).

Everything is rendered in this process from this checkout's code, with only the package's own algorithms registered.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's dare, whatever is installed
sys.path.insert(0, str(ROOT / "scripts"))  # the grid and plan scripts below

import make_paper_recipes  # noqa: E402
import plan_recipes  # noqa: E402

PAPER_MARKERS = ("<!-- paper-settings:start -->", "<!-- paper-settings:end -->")
TABLE_MARKERS = ("<!-- comparison-table:start -->", "<!-- comparison-table:end -->")
SUMMARY_MARKERS = ("<!-- comparison-summary:start -->", "<!-- comparison-summary:end -->")
GRID_MARKERS = ("<!-- paper-grid:start -->", "<!-- paper-grid:end -->")
CASES_MARKERS = ("<!-- loss-parity-cases:start -->", "<!-- loss-parity-cases:end -->")
COMPARISON_DATA = ROOT / "docs" / "comparison.json"

# path -> new text, or None for a file to remove (a recipe the grid no longer has)
Rendered = dict[Path, Optional[str]]


def replace_between(text: str, markers: tuple[str, str], body: str, where: str) -> str:
    """``text`` with what lies between the two marker lines replaced by ``body`` (the markers and the rest kept)."""
    start, end = text.find(markers[0]), text.find(markers[1])
    if start < 0 or end < start:
        raise ValueError(f"{where}: no '{markers[0]}' ... '{markers[1]}' block to regenerate")
    return text[:start + len(markers[0])] + "\n" + body + "\n" + text[end:]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def readme_matrix() -> Rendered:
    from dare.algorithms.matrix import with_matrix
    readme = ROOT / "README.md"
    return {readme: with_matrix(_read(readme), "README.md")}


def paper_recipes() -> Rendered:
    files: Rendered = dict(make_paper_recipes.render_all())
    for extra in set(make_paper_recipes.OUT.rglob("*.yaml")) - set(files):
        files[extra] = None
    return files


def paper_grid_table() -> Rendered:
    doc = ROOT / "docs" / "paper_recipes.md"
    return {doc: replace_between(_read(doc), GRID_MARKERS, make_paper_recipes.grid_table(), "docs/paper_recipes.md")}


def paper_settings_docs() -> Rendered:
    from dare.algorithms import ALGORITHMS, load_builtin_algorithms
    from dare.algorithms.paper import paper_markdown
    from dare.comparison.departures import departure_markdown
    load_builtin_algorithms()
    out: Rendered = {}
    for name, cls in sorted(ALGORITHMS.items()):
        if getattr(cls, "paper", None) is None:
            continue
        doc = ROOT / "docs" / "algorithms" / f"{name}.md"
        if not doc.is_file():
            raise ValueError(f"{doc.relative_to(ROOT)} is missing: a method with paper settings has a doc with a "
                             f"'## Paper settings' section holding the {PAPER_MARKERS[0]} ... {PAPER_MARKERS[1]} lines")
        block = paper_markdown(cls) + departure_markdown(name)
        out[doc] = replace_between(_read(doc), PAPER_MARKERS, block, str(doc.relative_to(ROOT)))
    return out


def plan_tables() -> Rendered:
    return dict(plan_recipes.rendered(json.loads(plan_recipes.OUT_JSON.read_text())))


def comparison_report() -> Rendered:
    from dare.comparison.departures import lr_departures
    from dare.comparison.report import load_data, render_summary, render_table
    data = load_data(COMPARISON_DATA)
    table = render_table(data)
    summary = render_summary(data, lr_departures())
    doc, readme = ROOT / "docs" / "comparison.md", ROOT / "README.md"
    text = replace_between(_read(doc), TABLE_MARKERS, table, "docs/comparison.md")
    return {ROOT / "docs" / "comparison_table.md": table,
            doc: replace_between(text, SUMMARY_MARKERS, summary, "docs/comparison.md"),
            readme: replace_between(_read(readme), SUMMARY_MARKERS, summary, "README.md")}


def loss_parity_cases() -> Rendered:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # tests.algorithms.parity_io reads the case files
    from tests.algorithms.parity_io import cases_markdown
    doc = ROOT / "docs" / "loss_parity.md"
    return {doc: replace_between(_read(doc), CASES_MARKERS, cases_markdown(), "docs/loss_parity.md")}


ARTIFACTS: dict[str, Callable[[], Rendered]] = {
    "matrix": readme_matrix, "paper-recipes": paper_recipes, "paper-grid": paper_grid_table, "paper-settings": paper_settings_docs,
    "plans": plan_tables, "comparison": comparison_report,
    "loss-parity": loss_parity_cases,
}


def stale(artifacts: dict[str, Callable[[], Rendered]]) -> list[tuple[str, Path, Optional[str]]]:
    """(artifact, file, new text or None to remove) for every file on disk that differs from its rendering."""
    out = []
    for name, render in artifacts.items():
        for path, text in render().items():
            current = _read(path) if path.is_file() else None
            if current != text:
                out.append((name, path, text))
    return out


def write(changes: list[tuple[str, Path, Optional[str]]]) -> None:
    for _, path, text in changes:
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if any artifact is stale")
    ap.add_argument("--only", nargs="+", choices=list(ARTIFACTS), default=None, help="these artifacts only")
    args = ap.parse_args(argv)
    chosen = {n: f for n, f in ARTIFACTS.items() if args.only is None or n in args.only}
    try:
        changes = stale(chosen)
    except ValueError as e:  # a source that cannot be rendered (a doc without its markers): say which, fail
        print(f"error: {e}")
        return 1
    for name, path, text in changes:
        what = "not generated any more" if text is None else "missing" if not path.is_file() else "stale"
        print(f"{'' if args.check else 'updating '}{_shown(path)}: {what} ({name})")
    if args.check:
        if changes:
            print(f"{len(changes)} generated file(s) out of date: run `python scripts/generate.py`")
        return 1 if changes else 0
    write(changes)
    # Two artifacts may own blocks of one file (docs/paper_recipes.md: the grid table and the planned resources), each
    # rendered from the file as it was: render again until nothing changes
    for _ in range(3):
        again = stale(chosen)
        if not again:
            break
        write(again)
    else:
        if stale(chosen):
            print("error: the generated files do not settle (two artifacts rewrite the same block)")
            return 1
    print(f"{len(changes)} file(s) updated; {', '.join(chosen)} up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
