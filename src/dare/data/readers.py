"""Read raw records from local files: parquet, jsonl, jsonl.gz, json, csv (and .gz of the text ones).

Each record comes with its row index (0-based, data rows only) and, for text formats, its 1-based line
number, so a malformed row can be reported as ``file, row N (line M)``. CSV cells stay strings: a 4x4
sudoku puzzle such as ``0140...`` must keep its leading zero.

Text is decoded line by line, so bytes that are not UTF-8 are reported with their file, row and line. Problems
confined to one row (a line that is not JSON, not an object, not UTF-8; a ragged CSV row) go to ``on_bad``
(``BadRowPolicy.handle``: raise, or log and skip under ``on_bad_row: skip``); without it they raise.
"""
from __future__ import annotations

import csv
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from .schema import DataError, where

FILE_TYPES = ("parquet", "jsonl", "json", "csv")
# The longest line a text file may have: a line is read whole before it is parsed, so this bounds the memory one
# row of a JSONL or CSV file can take (a longer line is a bad row; its bytes are skipped without being kept).
MAX_LINE_BYTES = 64 << 20


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


def _raise(err: DataError) -> None:
    raise err


OnBad = Callable[[DataError], None]


def _binary_lines(path: Path) -> Iterator[tuple[int, Optional[bytes]]]:
    """(line number, bytes) per line; None for a line longer than ``MAX_LINE_BYTES`` (skipped in 1 MiB pieces)."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    cap = MAX_LINE_BYTES
    with opener(path, "rb") as f:
        line_no = 0
        while True:
            raw = f.readline(cap + 1)
            if not raw:
                return
            line_no += 1
            if len(raw) > cap and not raw.endswith(b"\n"):
                while True:
                    piece = f.readline(1 << 20)
                    if not piece or piece.endswith(b"\n"):
                        break
                yield line_no, None
                continue
            yield line_no, raw


def _too_long(loc: str) -> DataError:
    return DataError(f"{loc}: the line has more than {MAX_LINE_BYTES} bytes (dare.data.readers.MAX_LINE_BYTES); "
                     f"no row of text data is that long")


def _decode(raw: Optional[bytes], loc: str) -> str:
    if raw is None:
        raise _too_long(loc)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{loc}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line); "
                        f"re-encode the file as UTF-8") from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _lone_surrogate(value, field: str = "") -> Optional[str]:
    """``"field 'a' holds ..."`` for the first string under ``value`` with a lone UTF-16 surrogate (JSON's
    ``"\\ud800"`` without its pair decodes to one: no tokenizer takes it), else None."""
    if isinstance(value, str):
        for i, c in enumerate(value):
            if "\ud800" <= c <= "\udfff":
                return (f"field {field!r} " if field else "") + \
                    f"holds a lone UTF-16 surrogate (\\u{ord(c):04x} at character {i + 1}), which is not text"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        name = f"{field}[{key}]" if isinstance(key, int) else f"{field}.{key}" if field else str(key)
        found = _lone_surrogate(item, name)
        if found:
            return found
    return None


def _parquet(path: Path, on_bad: OnBad) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read parquet: {e}") from e
    for i, data in enumerate(rows):
        yield Record(str(path), i, None, data)


def _jsonl(path: Path, on_bad: OnBad) -> Iterator[Record]:
    row = 0
    for line_no, raw in _binary_lines(path):
        if raw is not None and not raw.strip():
            continue
        loc = where(str(path), row, line_no)
        row += 1  # a bad row keeps its number, so the ids of the rows after it do not depend on on_bad_row
        try:
            data = json.loads(_decode(raw, loc))
        except json.JSONDecodeError as e:
            on_bad(DataError(f"{loc}: invalid JSON: {e.msg} (column {e.colno})"))
            continue
        except DataError as e:
            on_bad(e)
            continue
        if not isinstance(data, dict):
            on_bad(DataError(f"{loc}: expected a JSON object, got {type(data).__name__}"))
            continue
        if _SURROGATE_ESCAPE.search(raw):  # cheap: only a line that escapes a surrogate can hold a lone one
            problem = _lone_surrogate(data)
            if problem:
                on_bad(DataError(f"{loc}: {problem}"))
                continue
        yield Record(str(path), row - 1, line_no, data)


def _json(path: Path, on_bad: OnBad) -> Iterator[Record]:
    lines = []
    for line_no, line in _binary_lines(path):
        if line is None:
            raise _too_long(f"{path} (line {line_no})")
        lines.append(line)
    raw = b"".join(lines)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path} (line {line}): not UTF-8 text (byte 0x{raw[e.start]:02x}); re-encode the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON (line {e.lineno}): {e.msg}") from e
    if isinstance(data, dict):  # {"data": [...]} / {"examples": [...]}
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON list of objects (or one mapping holding a single list)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    escapes = _SURROGATE_ESCAPE.search(raw) is not None
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            on_bad(DataError(f"{where(str(path), i)}: expected a JSON object, got {type(item).__name__}"))
            continue
        problem = _lone_surrogate(item) if escapes else None
        if problem:
            on_bad(DataError(f"{where(str(path), i)}: {problem}"))
            continue
        yield Record(str(path), i, None, item)


def _text_lines(path: Path) -> Iterator[str]:
    """Decoded lines for the csv module; a line that is not UTF-8 stops the file (a CSV row may span lines)."""
    for line_no, raw in _binary_lines(path):
        yield _decode(raw, f"{path} (line {line_no})")


def _csv(path: Path, on_bad: OnBad) -> Iterator[Record]:
    delimiter = "\t" if ".tsv" in path.name.lower() else ","
    reader = csv.DictReader(_text_lines(path), delimiter=delimiter)
    try:
        if not reader.fieldnames:
            raise DataError(f"{path}: empty CSV (no header row)")
        yield from _csv_rows(path, reader, on_bad)
    except csv.Error as e:  # e.g. a cell over the csv module's 128 KiB field limit
        raise DataError(f"{path} (near line {reader.line_num + 1}): malformed CSV: {e}") from None


def _csv_rows(path: Path, reader: csv.DictReader, on_bad: OnBad) -> Iterator[Record]:
    for i, data in enumerate(reader):
        if None in data or any(v is None for v in data.values()):
            cells = sum(v is not None for k, v in data.items() if k is not None) + len(data.get(None, []))
            on_bad(DataError(f"{where(str(path), i, reader.line_num)}: row has {cells} cells, "
                             f"the header has {len(reader.fieldnames)}"))
            continue
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


def read_records(path, on_bad: Optional[OnBad] = None) -> Iterator[Record]:
    """Records of a local file; row-level problems go to ``on_bad`` (default: raise them)."""
    path = resolve_data_path(path)
    if path.is_dir():
        raise IsADirectoryError(f"data file {path} is a directory, not a file; name a .jsonl, .parquet, .json or .csv "
                                f"file in it")
    if path.exists() and not path.is_file():
        raise DataError(f"data file {path} is not a regular file (a device, pipe or socket); name a .jsonl, "
                        f".parquet, .json or .csv file")
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    return _READERS[file_type(path)](path, on_bad or _raise)
