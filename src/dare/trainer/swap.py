"""Folders a user may read while a run goes on (the export) are written beside and swapped in whole.

``save_pretrained`` into the live folder deletes the old weights before it writes the new ones: a kill in between
leaves an export with no weights, and a reader loading it meanwhile fails. Instead the new folder is written to
``staging(out)`` (``.<name>.partial`` beside it; a leftover of a killed write is removed first) and ``replace(staged,
out)`` puts it in place: on Linux with ``renameat2(RENAME_EXCHANGE)``, one atomic step in which ``out`` always holds a
complete folder (the old one, then the new one); elsewhere with two renames microseconds apart. The old folder is
then removed; a reader that already opened its files keeps reading them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from pathlib import Path

from ..files import fsync_dir as _fsync_dir

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging(out: Path) -> Path:
    """An empty folder beside ``out`` to write its next version into."""
    staged = out.parent / f".{out.name}.partial"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    return staged


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux >= 3.15 with glibc >= 2.28); False where that is not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(str(a)), _AT_FDCWD, os.fsencode(str(b)), _RENAME_EXCHANGE) == 0


def replace(staged: Path, out: Path) -> None:
    """Put the complete folder ``staged`` at ``out`` (see the module docstring)."""
    _fsync_tree(staged)
    if not out.exists():
        os.rename(staged, out)
    elif _exchange(staged, out):
        shutil.rmtree(staged, ignore_errors=True)  # now the old version
    else:
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
        os.rename(staged, out)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(out.parent)

