"""Read raw records from local files: parquet, jsonl, jsonl.gz, json, csv (and .gz of the text ones).

Each record comes with its row index (0-based, data rows only) and, for text formats, its 1-based line
number, so a malformed row can be reported as ``file, row N (line M)``. CSV cells stay strings: a 4x4
sudoku puzzle such as ``0140...`` must keep its leading zero.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from .schema import DataError, where

FILE_TYPES = ("parquet", "jsonl", "json", "csv")


@dataclass
class Record:
    source: str
    row: int
    line: Optional[int]
    data: dict

    @property
    def loc(self) -> str:
        return where(self.source, self.row, self.line)


def file_type(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for ext, kind in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"),
                      (".csv", "csv"), (".tsv", "csv")):
        if name.endswith(ext):
            return kind
    raise DataError(f"{path}: unknown data file type (expected one of .parquet, .jsonl, .jsonl.gz, .json, .csv)")


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet: {e}") from e
    for i, data in enumerate(rows):
        yield Record(str(path), i, None, data)


def _jsonl(path: Path) -> Iterator[Record]:
    row = 0
    with _open_text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where(str(path), row, line_no)}: invalid JSON: {e.msg}") from e
            if not isinstance(data, dict):
                raise DataError(f"{where(str(path), row, line_no)}: expected a JSON object, got {type(data).__name__}")
            yield Record(str(path), row, line_no, data)
            row += 1


def _json(path: Path) -> Iterator[Record]:
    with _open_text(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON (line {e.lineno}): {e.msg}") from e
    if isinstance(data, dict):  # {"data": [...]} / {"examples": [...]}
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON list of objects (or one mapping holding a single list)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise DataError(f"{where(str(path), i)}: expected a JSON object, got {type(item).__name__}")
        yield Record(str(path), i, None, item)


def _csv(path: Path) -> Iterator[Record]:
    delimiter = "\t" if ".tsv" in path.name.lower() else ","
    with _open_text(path) as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if not reader.fieldnames:
            raise DataError(f"{path}: empty CSV (no header row)")
        for i, data in enumerate(reader):
            if None in data or any(v is None for v in data.values()):
                cells = sum(v is not None for k, v in data.items() if k is not None) + len(data.get(None, []))
                raise DataError(f"{where(str(path), i, reader.line_num)}: row has {cells} cells, "
                                f"the header has {len(reader.fieldnames)}")
            yield Record(str(path), i, reader.line_num, dict(data))


_READERS = {"parquet": _parquet, "jsonl": _jsonl, "json": _json, "csv": _csv}


BUNDLED_PREFIX = "bundled:"


def resolve_data_path(path) -> Path:
    """A data file path; ``bundled:<rel>`` names a file shipped in ``dare/assets/data`` (works from any directory and
    in a pip-installed dare, e.g. ``bundled:quickstart/sudoku_lazy_train.jsonl``)."""
    text = str(path)
    if text.startswith(BUNDLED_PREFIX):
        from .registry import ASSETS
        return ASSETS / text[len(BUNDLED_PREFIX):]
    return Path(text).expanduser()


def read_records(path) -> Iterator[Record]:
    path = resolve_data_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    return _READERS[file_type(path)](path)
