"""Per-sample JSONL results that survive being killed: append + flush + fsync per batch, resume by id.

A run killed mid-write can leave a partial last line; it is cut off on reopen (and logged), so the file
always holds whole records. A corrupt line elsewhere is an error naming the file and line: the file is ours,
so that is damage, not something to skip silently. ``<name>.meta.json`` records the settings that shaped the
samples; resuming under different settings is an error instead of a silent mix of two configurations.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable, Optional

log = logging.getLogger(__name__)


class SampleStore:
    def __init__(self, path: Optional[Path], settings: Optional[dict] = None, resume: bool = True):
        self.path = Path(path) if path is not None else None
        self.records: dict[tuple[str, int], dict] = {}
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        meta = self.path.with_suffix(".meta.json")
        if not resume:
            for p in (self.path, meta):
                if p.exists():
                    p.unlink()
        if settings is not None:
            self._check_settings(meta, settings)
        if self.path.exists():
            self._load()

    def _check_settings(self, meta: Path, settings: dict) -> None:
        settings = json.loads(json.dumps(settings, default=str))  # what a JSON round trip gives back
        if meta.exists() and self.path.exists():
            old = json.loads(meta.read_text())
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            if diff:
                raise ValueError(f"{self.path} holds samples made with different settings ({', '.join(diff)} changed: "
                                 f"{ {k: old.get(k) for k in diff} } -> { {k: settings.get(k) for k in diff} }); "
                                 "use another output dir or --no-resume")
        meta.write_text(json.dumps(settings, indent=1, sort_keys=True))

    def _load(self) -> None:
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            keep = raw.rfind(b"\n") + 1
            log.warning("%s: dropping a partial last line (%d bytes) left by an interrupted run", self.path, len(raw) - keep)
            with open(self.path, "r+b") as f:
                f.truncate(keep)
            raw = raw[:keep]
        for line_no, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (rec["id"], int(rec.get("sample", 0)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{self.path}, line {line_no}: not a sample record ({e}); delete the file or use --no-resume") from e
            self.records[key] = rec

    def done(self, example_id: str, sample: int = 0) -> bool:
        return (example_id, sample) in self.records

    def append(self, records: Iterable[dict]) -> None:
        new = [r for r in records if (r["id"], r.get("sample", 0)) not in self.records]
        for r in new:
            self.records[(r["id"], r.get("sample", 0))] = r
        if self.path is None or not new:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
            f.flush()
            os.fsync(f.fileno())
