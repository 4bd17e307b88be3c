"""Files a reader may open at any moment (metrics, plots, results tables), written beside and renamed into place.

A file rewritten in place is empty or half written for as long as the write takes: a viewer refreshing the training
curves, a script polling ``results.json`` or a resume reading ``metrics.jsonl`` can read it so. ``write_file`` writes
``.<stem>.partial<suffix>`` beside the file, flushes it to disk and renames it over the old one (atomic on POSIX): a
reader finds the old file or the new one, whole. The lowest layer of dare (it imports nothing of dare), so every
package may write this way; folders (the export) are swapped by ``dare.trainer.swap``.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk; a file system that cannot is left as it is."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, write) -> None:
    """``write(tmp)`` makes the file beside ``path`` (same folder, same suffix, so writers that read the format from
    the name keep it), which is then flushed and renamed over ``path``: a reader finds the old file or the new one,
    never a half-written one; a failed write removes its ``.partial`` file, and one a kill leaves is replaced by the
    next write."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk stays full otherwise
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, swapped in (``write_file``)."""
    write_file(path, lambda tmp: Path(tmp).write_text(text))
