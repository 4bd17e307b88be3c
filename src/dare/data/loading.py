"""``load_examples(DataConfig) -> list[dict]``: read a dataset from any source into normalised examples."""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Iterator, Optional

from .config import DataConfig
from .layouts import Context, detect_layout, get_layout
from .readers import Record, read_records
from .registry import get_dataset
from .schema import BadRowPolicy, DataError, shown, validate_example, where

log = logging.getLogger(__name__)


def _hf_records(hf_id: str, config: Optional[str], split: str) -> Iterator[Record]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"loading the Hugging Face dataset {hf_id!r} needs the `datasets` package "
                          "(pip install datasets), or use a bundled dataset name / a local file") from e
    ds = datasets.load_dataset(hf_id, config, split=split)
    source = f"hf:{hf_id}" + (f"/{config}" if config else "") + f"[{split}]"
    for i, row in enumerate(ds):
        yield Record(source, i, None, dict(row))


_NO_FIXES = {"bad": {}, "setup": {}}


def _loader_records(ref: str, split: str) -> Iterator[Record]:
    """The rows a user's loader function returns (``data.loader``), called with the split name when it takes an
    argument: each row a dict, in any layout ``format`` reads."""
    import inspect

    from ..config.references import load_reference
    fn = load_reference(ref, "data.loader")
    try:
        takes_split = bool(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function: give it the split
        takes_split = True
    rows = fn(split) if takes_split else fn()
    if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__"):
        raise DataError(f"data.loader {ref!r} returned a {type(rows).__name__}; it must return (or yield) the rows, "
                        "each a dict")
    source = f"loader:{ref}[{split}]"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{where(source, i, None)}: data.loader rows must be dicts, got {type(row).__name__}")
        yield Record(source, i, None, dict(row))


def _resolve(cfg: DataConfig, policy: BadRowPolicy):
    """(records, layout name, id prefix, dataset short name, default task, fixes) for the configured source; ``fixes``
    holds the bundled file's known-bad rows and restored test setup code (``DatasetSpec``)."""
    if cfg.path:
        path = Path(cfg.path).expanduser()
        stem = path.name.split(".")[0]
        return read_records(path, policy.handle), cfg.format, stem, stem, None, _NO_FIXES
    if cfg.loader:
        stem = cfg.loader.split(":")[-1]
        return _loader_records(cfg.loader, cfg.split), cfg.format, f"{stem}/{cfg.split}", stem, None, _NO_FIXES
    if cfg.hf:
        split = cfg.split
        return _hf_records(cfg.hf, cfg.hf_config, split), cfg.format, f"{cfg.hf}/{split}", cfg.hf.split("/")[-1], None, _NO_FIXES
    spec = get_dataset(cfg.name)
    bundled = spec.bundled(cfg.split)
    hf = spec.hf.get(cfg.split)
    if cfg.source == "bundled" or (cfg.source == "auto" and bundled is not None):
        if bundled is None:
            raise ValueError(f"dataset {cfg.name!r} has no bundled split {cfg.split!r} (bundled: "
                             f"{', '.join(sorted(spec.files)) or 'none'}); set data.source: hf or give data.path")
        fixes = {"bad": spec.known_bad.get(cfg.split, {}), "setup": spec.restored_setup.get(cfg.split, {})}
        return read_records(bundled, policy.handle), cfg.format, f"{cfg.name}/{cfg.split}", cfg.name, spec.task, fixes
    if hf is None:
        raise ValueError(f"dataset {cfg.name!r} has no split {cfg.split!r} (splits: {', '.join(spec.splits)})")
    fmt = cfg.format if cfg.format != "auto" else hf.format
    return _hf_records(hf.path, hf.config, hf.split or cfg.split), fmt, f"{cfg.name}/{cfg.split}", cfg.name, spec.task, _NO_FIXES


def iter_examples(cfg: DataConfig, policy: Optional[BadRowPolicy] = None) -> Iterator[dict]:
    """Examples in file order; bad rows raise (``on_bad_row: error``) or are logged and skipped."""
    policy = policy or BadRowPolicy(cfg.on_bad_row)
    records, fmt, prefix, source, task, fixes = _resolve(cfg, policy)
    known_bad, setups = fixes["bad"], fixes["setup"]
    layout = None if fmt == "auto" else get_layout(fmt)
    ctx = Context(prefix, source, cfg.task)
    for rec in records:
        if rec.row in known_bad:  # documented in the registry and assets/data/SOURCES.md
            log.info("%s: dropping a known-bad row of the bundled file: %s", rec.loc, known_bad[rec.row])
            continue
        if layout is None:
            layout = detect_layout(rec)
        try:
            ex = layout.parse(rec, ctx)
            if rec.row in setups and isinstance(ex.get("ground_truth"), dict):  # documented in the registry
                ex["ground_truth"] = {**ex["ground_truth"], "tests": setups[rec.row] + ex["ground_truth"]["tests"]}
            ex = validate_example(ex, rec.loc)
            if task is not None and cfg.task is None and ex["task"] != task:
                raise DataError(f"{rec.loc}: row parsed as task {shown(ex['task'])}, but dataset {source!r} is {task!r}")
        except DataError as e:
            policy.handle(e)
            continue
        except Exception as e:  # a parser bug on odd input must still name the row
            policy.handle(DataError(f"{where(rec.source, rec.row, rec.line)}: cannot parse row: {type(e).__name__}: {e}"))
            continue
        yield ex


def load_examples(cfg: DataConfig) -> list[dict]:
    """All examples of ``cfg`` (shuffled with ``shuffle_seed`` when set, then cut to ``limit``)."""
    policy = BadRowPolicy(cfg.on_bad_row)
    if cfg.mix:
        out = [ex for part in cfg.mix for ex in load_examples(part)]
        if cfg.shuffle_seed is not None:
            random.Random(cfg.shuffle_seed).shuffle(out)
        if cfg.limit is not None:
            out = out[:cfg.limit]
    elif cfg.shuffle_seed is None and cfg.limit is not None:
        out = []
        for ex in iter_examples(cfg, policy):
            if len(out) >= cfg.limit:
                break
            out.append(ex)
    else:
        from . import parsed  # rows a process parsed before (dare/data/parsed.py)
        k = parsed.key(cfg, parsed.source_file(cfg))
        kept = parsed.get(k)
        if kept is None:
            out = list(iter_examples(cfg, policy))
            if not policy.skipped:
                parsed.put(k, out)
        else:
            out = kept
        if cfg.shuffle_seed is not None:
            random.Random(cfg.shuffle_seed).shuffle(out)
        if cfg.limit is not None:
            out = out[:cfg.limit]
        if kept is not None:
            out = parsed.detached(out)
    policy.summary(cfg.describe())
    ids = set()
    for ex in out:
        if ex["id"] in ids:
            raise DataError(f"{cfg.describe()}: duplicate example id {shown(ex['id'])}")
        ids.add(ex["id"])
    return out
