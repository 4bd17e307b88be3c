"""A memory cgroup around each sandboxed process tree: a sample's memory bounded as a whole.

RLIMIT_AS bounds each process's address space, so a sample that forks (up to ``max_processes``) could hold that many
times ``memory_bytes``, and pages a sample writes to its tmpfs scratch count in no process. A cgroup counts them all:
every process the sample starts, the memory it touches and the tmpfs pages it writes, and the kernel kills inside the
cgroup (never outside) when the sum passes the limit. ``memory_cage(limit)`` makes one per spawned sandbox process
where the host lets us (cgroup v1's memory controller, or a cgroup v2 subtree with the memory controller enabled,
writable by us: root in a container, a delegated systemd scope); elsewhere it returns None and the sandbox keeps the
per-process RLIMIT_AS alone (``available()`` says which, ``DARE_SANDBOX_MEMORY_CGROUP=0`` turns cages off).

The child is moved into its cage before it runs anything of the sample: the launcher starts it behind
``/bin/sh -c 'read -r _ && exec "$@"'``, moves that process into the cage, then writes the line that lets it go on,
so every process of the sample (bwrap / unshare, the bootstrap, the program, its children, daemons that ``setsid``)
is born inside. Nothing of the cage is writable by the sample: the launcher, not the child, writes its pid.
"""
from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

GATE = ["/bin/sh", "-c", 'read -r _ && exec "$@"', "dare-sandbox"]  # waits for one line on stdin, then runs "$@"
_COUNTER = itertools.count()
_PROBE: dict = {}


def _mounts() -> list[tuple[str, str, set]]:
    """(mount point, file-system type, super options) of the cgroup mounts."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                    out.append((fields[4], tail[0], set(tail[2].split(","))))
    except OSError:
        pass
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller ("memory") and for v2 (key "")."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    out[c] = path
    except OSError:
        pass
    return out


def _candidates() -> list[tuple[Path, int]]:
    """(parent folder for cages, cgroup version), the nearest to this process's own cgroup first."""
    own = _own_paths()
    out = []
    for point, kind, options in _mounts():
        if kind == "cgroup" and "memory" in options:
            for base in (Path(point) / own.get("memory", "/").lstrip("/"), Path(point)):
                out.append((base, 1))
        elif kind == "cgroup2":
            base = Path(point) / own.get("", "/").lstrip("/")
            for parent in (base, Path(point)):
                try:
                    if "memory" in (parent / "cgroup.subtree_control").read_text().split():
                        out.append((parent, 2))
                except OSError:
                    pass
    return list(dict.fromkeys(out))  # each once, in order


class MemoryCage:
    """One cgroup limited to ``limit`` bytes (no swap where the host accounts it)."""

    def __init__(self, parent: Path, version: int, limit: int):
        self.version, self.limit = version, limit
        self.path = parent / f"dare-sandbox-{os.getpid()}-{next(_COUNTER)}"
        self.path.mkdir()
        try:
            if version == 1:
                self._write("memory.limit_in_bytes", limit)
                self._try("memory.memsw.limit_in_bytes", limit)  # exists where swap is accounted
            else:
                self._write("memory.max", limit)
                self._try("memory.swap.max", 0)
                self._try("memory.oom.group", 1)  # an OOM kills the whole sample, not one process of it
        except OSError:
            self.close()
            raise

    def _write(self, name: str, value) -> None:
        with open(self.path / name, "w") as f:
            f.write(f"{value}\n")

    def _try(self, name: str, value) -> None:
        try:
            self._write(name, value)
        except OSError:
            pass

    def _read(self, name: str) -> str:
        try:
            return (self.path / name).read_text()
        except OSError:
            return ""

    def add(self, pid: int) -> None:
        """Move ``pid`` (a child still waiting at the gate) into the cage."""
        self._write("cgroup.procs", pid)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the cage for passing the limit."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        for line in self._read(name).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value) > 0
        # kernels before 4.13 do not count OOM kills: the limit was reached (a sample that failed there was stopped by it)
        return self.version == 1 and self._read("memory.failcnt").strip() not in ("", "0")

    def peak(self) -> Optional[int]:
        """The most memory the cage held (None where the kernel does not say)."""
        text = self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak").strip()
        return int(text) if text.isdigit() else None

    def close(self) -> None:
        """Kill what is left in the cage (a daemon the sample started) and remove it."""
        for _ in range(50):
            pids = [int(p) for p in self._read("cgroup.procs").split() if p.isdigit()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        log.warning("sandbox memory cgroup %s could not be removed", self.path)


def _sweep(parent: Path) -> None:
    """Remove the empty cages of processes that are gone (a scorer killed before its ``close``)."""
    for path in parent.glob("dare-sandbox-*-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                path.rmdir()
            except OSError:
                pass


def memory_cage(limit: int) -> Optional[MemoryCage]:
    """A new cage of ``limit`` bytes, or None where this host gives none (probed once per process)."""
    if os.environ.get("DARE_SANDBOX_MEMORY_CGROUP", "1") == "0":
        return None
    if "where" in _PROBE:
        where = _PROBE["where"]
        if where is None:
            return None
        try:
            return MemoryCage(*where, limit)
        except OSError as e:
            log.warning("sandbox memory cgroup under %s failed (%s); samples keep the per-process limit only",
                        where[0], e)
            _PROBE["where"] = None
            return None
    _PROBE["where"] = None
    for parent, version in _candidates():
        try:
            cage = MemoryCage(parent, version, limit)
        except OSError:
            continue
        _PROBE["where"] = (parent, version)
        _sweep(parent)
        return cage
    return None


def available() -> Optional[str]:
    """Where cages are made ("cgroup v1 /sys/fs/cgroup/memory/...") or None."""
    cage = memory_cage(1 << 30)
    if cage is None:
        return None
    cage.close()
    parent, version = _PROBE["where"]
    return f"cgroup v{version} {parent}"
