"""The host side of the sandbox's isolation: what a candidate may see, and what a sample may leave behind.

**The view** (``bwrap`` and ``unshare`` modes). The candidate's file system is an empty read-only tmpfs holding only
what its interpreter needs, read-only: the interpreter binary, the standard library directories on its ``sys.path``
(with any ``site-packages`` / ``dist-packages`` inside them masked by an empty directory), the shared libraries the
interpreter maps once every extension module of its ``lib-dynload`` is imported, with the symlinks that name them
(``libz.so.1`` -> ``libz.so.1.2.13``, ``/lib`` -> ``usr/lib``), and the dynamic loader's cache ``/etc/ld.so.cache``
(a list of library paths). Nothing else of the host: no package data (dare's bundled datasets included), no home or
working directory, no ``/etc``, ``/sys``, ``/run`` or host ``/tmp``. The view is measured once per interpreter by
running it (outside any sandbox) and reading its own ``/proc/self/maps``.

**Leftovers** (the ``none`` fallback, which has no namespaces; as root each sample runs as its own uid): on release
the uid's processes are killed, its files in the world-writable directories removed, and its SysV IPC objects (shared
memory, message queues, semaphore sets) removed. Under ``bwrap``/``unshare`` IPC objects live in the sample's own IPC
namespace and files in its own tmpfs, both gone with its last process; the same cleanup runs there as a second line.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

# Run by the interpreter itself: import every extension module it ships, then list every file it has mapped.
_PROBE = r"""
import json, os, sys
for entry in sys.path:
    if entry.endswith("lib-dynload") and os.path.isdir(entry):
        for name in sorted(os.listdir(entry)):
            if name.endswith(".so"):
                try:
                    __import__(name.split(".")[0])
                except BaseException:
                    pass
mapped = set()
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.rstrip("\n").split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and not parts[5].endswith(" (deleted)"):
            mapped.add(parts[5])
print(json.dumps({"executable": sys.executable, "path": [p for p in sys.path if p], "mapped": sorted(mapped)}))
"""
_USRMERGE_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PACKAGE_DIRS = ("site-packages", "dist-packages")
_LOADER_CACHE = "/etc/ld.so.cache"


@dataclass(frozen=True)
class View:
    """What a sandboxed interpreter sees: ``entries`` are ``("bind", path)`` (read-only, same path), ``("symlink",
    target, path)`` and ``("mask", path)`` (an empty read-only directory over a package directory), in mount order."""
    executable: str
    entries: tuple


_views: dict[str, View] = {}
_views_lock = threading.Lock()


def interpreter_view(python: str) -> View:
    """The view for ``python`` (measured once per process and interpreter)."""
    real = os.path.realpath(python)
    with _views_lock:
        if real not in _views:
            _views[real] = _measure(real)
        return _views[real]


def _measure(python: str) -> View:
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    try:
        done = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=120, env=env,
                              stdin=subprocess.DEVNULL, cwd="/")
        info = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        raise RuntimeError(f"cannot measure the sandbox interpreter {python}: {err}") from None
    if info is None:
        raise RuntimeError(f"cannot measure the sandbox interpreter {python}: {done.stderr.strip()[-300:]}")
    binds: set[str] = set()
    links: dict[str, str] = {}
    stdlib_dirs = [p for p in info["path"] if os.path.isdir(p)]
    wanted = [python] + [p for p in info["path"] if os.path.exists(p)] + info["mapped"]
    wanted += [p for p in (_LOADER_CACHE, _elf_interpreter(python)) if p and os.path.exists(p)]
    for path in wanted:
        _follow(path, binds, links)
    for path in [p for p in binds if os.path.isfile(p) and ".so" in os.path.basename(p)]:
        _sonames(path, binds, links)  # the names the loader looks libraries up by
    for path in _USRMERGE_LINKS:  # the link only (/lib -> usr/lib), so paths in the loader's cache resolve
        if os.path.islink(path):
            links[path] = os.readlink(path)
    dirs = sorted(p for p in binds if os.path.isdir(p))
    covered = lambda p: any(p != d and p.startswith(d.rstrip("/") + "/") for d in dirs)  # noqa: E731
    entries = [("bind", p) for p in sorted(binds, key=lambda p: (p.count("/"), p)) if not covered(p)]
    entries += [("mask", os.path.join(d, sub)) for d in stdlib_dirs for sub in _PACKAGE_DIRS
                if os.path.isdir(os.path.join(d, sub))]
    entries += [("symlink", target, path) for path, target in sorted(links.items()) if not covered(path)]
    return View(os.path.realpath(info["executable"]), tuple(entries))


def _elf_interpreter(binary: str) -> Optional[str]:
    """The dynamic loader an ELF executable names (PT_INTERP, e.g. /lib64/ld-linux-x86-64.so.2): the kernel opens
    it by that path, so the symlinks on the way must be in the view too."""
    import struct
    try:
        with open(binary, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return None
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide:
                phoff, = struct.unpack_from(order + "Q", head, 32)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            else:
                phoff, = struct.unpack_from(order + "I", head, 28)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
            # Program header fields: p_type, then p_offset and p_filesz at their class's offsets.
            offset_at, size_at, word = (8, 32, "Q") if wide else (4, 16, "I")
            for i in range(min(phnum, 256)):
                f.seek(phoff + i * phentsize)
                entry = f.read(phentsize)
                if struct.unpack_from(order + "I", entry, 0)[0] != 3:  # PT_INTERP
                    continue
                offset, = struct.unpack_from(order + word, entry, offset_at)
                size, = struct.unpack_from(order + word, entry, size_at)
                f.seek(offset)
                return f.read(min(size, 4096)).split(b"\0")[0].decode() or None
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _follow(path: str, binds: set, links: dict, depth: int = 0) -> None:
    """Record every symlink on the way from ``path`` to the file it names, and that file (to be bound)."""
    if depth > 16 or not os.path.isabs(path):
        return
    current = "/"
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            target = os.readlink(candidate)
            links[candidate] = target
            rest = "/".join(parts[i + 1:])
            resolved = os.path.normpath(os.path.join(os.path.dirname(candidate), target))
            _follow(os.path.join(resolved, rest) if rest else resolved, binds, links, depth + 1)
            return
        current = candidate
    if os.path.exists(current):
        binds.add(current)


def _sonames(library: str, binds: set, links: dict) -> None:
    folder = os.path.dirname(library)
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.is_symlink() and os.path.realpath(entry.path) == library:
            links[entry.path] = os.readlink(entry.path)


def bwrap_arguments(view: View, program: Optional[str], scratch_bytes: int, sized_tmpfs: bool) -> list[str]:
    """bubblewrap's options for ``view``: a read-only root holding the view, ``/dev``, a fresh ``/proc``, the program
    at ``/program.py`` (read-only) and the private size-capped scratch tmpfs ``/tmp`` and ``/dev/shm``."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for entry in view.entries:
        if entry[0] == "bind":
            args += ["--ro-bind", entry[1], entry[1]]
        elif entry[0] == "symlink":
            args += ["--symlink", entry[1], entry[2]]
        else:
            args += ["--tmpfs", entry[1], "--remount-ro", entry[1]]
    size = ["--size", str(scratch_bytes)] if sized_tmpfs else []
    args += ["--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--proc", "/proc",
             *size, "--tmpfs", "/tmp"]
    if program is not None:
        args += ["--ro-bind", program, "/program.py"]
    return args + ["--remount-ro", "/", "--chdir", "/tmp"]


def unshare_spec(view: View, root: str, program: Optional[str], scratch_bytes: int) -> dict:
    """What ``sandbox_mounts.enter_view`` builds inside an ``unshare`` sandbox (on the empty host folder ``root``)."""
    return {"root": root, "entries": [list(e) for e in view.entries], "scratch_bytes": scratch_bytes, "program": program}


_bwrap_size: Optional[bool] = None


def bwrap_sizes_tmpfs() -> bool:
    """Whether this bubblewrap caps a tmpfs with ``--size`` (0.5 and later); older ones get an uncapped scratch."""
    global _bwrap_size
    if _bwrap_size is None:
        try:
            text = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        _bwrap_size = "--size" in text
    return _bwrap_size


# ----------------------------------------------------------------------------------------------------------------
# leftovers
# ----------------------------------------------------------------------------------------------------------------
def remove_ipc_of(uid: int) -> int:
    """Remove every SysV shared-memory segment, message queue and semaphore set created by or owned by ``uid`` in
    this IPC namespace (``/proc/sysvipc``); returns how many. Root only; others are left to the kernel's rules."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    removers = {"shm": lambda i: libc.shmctl(i, 0, None), "msg": lambda i: libc.msgctl(i, 0, None),
                "sem": lambda i: libc.semctl(i, 0, 0)}  # IPC_RMID = 0
    removed = 0
    for kind, remove in removers.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        header = lines[0].split()
        try:
            uid_col, cuid_col = header.index("uid"), header.index("cuid")
        except ValueError:
            continue
        for line in lines[1:]:
            cols = line.split()
            if len(cols) > max(uid_col, cuid_col) and uid in (int(cols[uid_col]), int(cols[cuid_col])):
                removed += remove(int(cols[1])) == 0
    if removed:
        log.info("removed %d SysV IPC object(s) left by sandbox uid %d", removed, uid)
    return removed
