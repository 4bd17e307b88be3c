"""The sandbox's dedicated uids (when the scorer runs as root): a slot per live sandbox, locked with ``flock`` across
processes, and the release that kills every process of the uid and removes its files and IPC objects."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
import tempfile
import time

from .sandbox_host import remove_ipc_of

_UID_BASE = int(os.environ.get("DARE_SANDBOX_UID_BASE", "64000"))
_UID_SLOTS = 256
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")


def _proc_uids() -> list[tuple[int, int]]:
    """(pid, uid) of every non-zombie process visible in /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{name}").st_uid
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            out.append((int(name), uid))
    return out


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process owned by ``uid`` until none is left; returns how many were killed.
    Repeats because a fork bomb can start children while we scan (RLIMIT_NPROC bounds it)."""
    killed = 0
    for _ in range(rounds):
        pids = [pid for pid, owner in _proc_uids() if owner == uid]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return killed


def _remove_files_of(uid: int) -> None:
    for top in _WORLD_WRITABLE:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


class _UidSlot:
    """A uid no other live sandbox uses, held with an exclusive ``flock`` until released."""

    def __init__(self) -> None:
        lock_dir = os.path.join(tempfile.gettempdir(), "dare-sandbox-uid-locks")
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        info = os.lstat(lock_dir)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise RuntimeError(f"{lock_dir} is not a directory owned by us; refusing to use it for sandbox locks")
        for uid in range(_UID_BASE, _UID_BASE + _UID_SLOTS):
            fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            kill_uid(uid)  # leftovers of a crashed earlier scorer
            return
        raise RuntimeError(f"all {_UID_SLOTS} sandbox uid slots from {_UID_BASE} are in use")

    def release(self) -> None:
        kill_uid(self.uid)
        _remove_files_of(self.uid)
        remove_ipc_of(self.uid)  # the fallback's IPC objects; a second line under bwrap/unshare (own IPC namespace)
        os.close(self._fd)
