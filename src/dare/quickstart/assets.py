"""The files the quickstart ships inside the package: small SFT checkpoints and the recipes that made them.

``dare/assets/quickstart/`` holds

* ``recipes/*.yaml``: the quickstart and comparison recipes (identical copies of ``recipes/quickstart/*.yaml``,
  which is where users read them; a test keeps the two in sync). Packaged so a pip-installed dare runs offline.
* one folder per shipped checkpoint (e.g. ``sudoku-llada-sft``) in the family's published layout
  (``model.save_pretrained``) + the tokenizer, with ``quickstart.json`` (which recipe and overrides produced it, the
  family, the overrides its RL and comparison runs need, its baseline numbers) and ``sft_metrics.jsonl`` (the SFT loss curve, drawn in the quickstart PNG).

Checkpoints are discovered from their ``quickstart.json``, never listed in code, so adding a family to the
comparison is adding a folder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ASSET_ROOT = Path(__file__).resolve().parents[1] / "assets" / "quickstart"
RECIPE_DIR = ASSET_ROOT / "recipes"
MANIFEST = "quickstart.json"


@dataclass(frozen=True)
class ShippedCheckpoint:
    name: str  # folder name, e.g. sudoku-llada-sft
    path: Path
    family: str  # model family (dare.models), e.g. llada, sdar
    task: str  # the embedded task its SFT data teaches (e.g. lazy_sudoku, sudoku); `dare compare --task`
    attention: str  # bidirectional | block_causal (what algorithms' ``supports`` lists)
    sft_recipe: str  # recipe file name in RECIPE_DIR that reproduces this checkpoint
    sft_overrides: tuple[str, ...]  # the dotted overrides it was trained with (on top of the recipe)
    # dotted overrides of the shared RL and comparison recipes for this checkpoint (e.g. the SDAR one decodes in
    # blocks of 4, its training block size), so every family runs the same settings otherwise
    recipe_overrides: tuple[str, ...]
    info: dict  # the rest of the manifest (baseline numbers, training time, ...)
    # dotted overrides of the quickstart's RL recipe only (not of the comparison), e.g. the plain-Sudoku checkpoints
    # keep the KL weight their documented runs used
    rl_overrides: tuple[str, ...] = ()

    @property
    def sft_metrics(self) -> Path:
        return self.path / "sft_metrics.jsonl"


def recipe_path(name: str) -> Path:
    """A packaged quickstart recipe by file name (``sft.yaml``, ``rl.yaml``, ...)."""
    path = RECIPE_DIR / name
    if not path.exists():
        known = ", ".join(sorted(p.name for p in RECIPE_DIR.glob("*.yaml")))
        raise FileNotFoundError(f"no quickstart recipe {name!r} in {RECIPE_DIR} (have: {known})")
    return path


def _load(folder: Path) -> ShippedCheckpoint:
    manifest = folder / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{manifest}: unreadable quickstart manifest ({e})") from e
    missing = [k for k in ("family", "task", "attention", "sft_recipe") if k not in data]
    if missing:
        raise ValueError(f"{manifest}: missing key(s) {missing}")
    own = ("family", "task", "attention", "sft_recipe", "sft_overrides", "recipe_overrides", "rl_overrides")
    info = {k: v for k, v in data.items() if k not in own}
    return ShippedCheckpoint(folder.name, folder, data["family"], data["task"], data["attention"], data["sft_recipe"],
                             tuple(data.get("sft_overrides", [])), tuple(data.get("recipe_overrides", [])), info,
                             tuple(data.get("rl_overrides", [])))


def shipped_checkpoints(root: Optional[Path] = None) -> dict[str, ShippedCheckpoint]:
    """Every shipped checkpoint (folders holding a quickstart.json), by folder name."""
    root = Path(root or ASSET_ROOT)
    found = {}
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if (p / MANIFEST).exists()):
            found[folder.name] = _load(folder)
    return found


def get_checkpoint(name: str, root: Optional[Path] = None) -> ShippedCheckpoint:
    found = shipped_checkpoints(root)
    if name not in found:
        raise ValueError(f"no shipped quickstart checkpoint {name!r}; shipped: {', '.join(found) or 'none'}")
    return found[name]


def checkpoint_for_family(family: str, task: str, root: Optional[Path] = None) -> ShippedCheckpoint:
    for ck in shipped_checkpoints(root).values():
        if ck.family == family and ck.task == task:
            return ck
    raise ValueError(f"no shipped quickstart checkpoint of family {family!r} for task {task!r}")
