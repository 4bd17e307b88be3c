"""Run untrusted Python (model-written code + its tests) in a contained subprocess.

Every run is a fresh ``python -I -S`` started with ``subprocess.Popen`` (never forked from the
trainer), in a new session, with a minimal environment, in a private temporary directory. A small
bootstrap inside the child sets rlimits (address space, CPU seconds, processes, file size, open
files, no core dumps) and then executes the program. Around that, the strongest available isolation
is used, probed once per process (``detect_isolation``):

``bwrap``    bubblewrap: new user/pid/net/ipc/uts namespaces, the file system read-only except a
             private /tmp and the run directory, the sandbox dies with its parent. Network access,
             writes outside the run directory and processes outliving the program are impossible.
``unshare``  util-linux ``unshare``: new user/net/pid/mount namespaces (no network; every process
             dies with the program), but the file system is the host's, so only permissions stop
             writes (see the uid note below).
``none``     the documented fallback: rlimits + clean environment + killing the process group.

When the scorer runs as root, each run also drops to its own unprivileged uid (a slot from
``DARE_SANDBOX_UID_BASE``, default 64000, 256 slots, locked with ``flock`` across processes): root
ignores RLIMIT_NPROC, and a dedicated uid lets us kill *every* process the program started (even
ones that called ``setsid``) and delete files it left in world-writable directories, in all modes.
Without root and without namespaces (``none`` as an ordinary user) a program that deliberately
signals or writes as that user is not contained: install bubblewrap.

Success needs more than exit status 0: the bootstrap writes a random token (given on stdin, never in
argv, environment or files) to a private pipe after the program finished, so ``os._exit(0)`` or
``sys.exit(0)`` before the tests ran scores as a failure.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "unshare", "none")
_ENV_ISOLATION = "DARE_SANDBOX_ISOLATION"  # force a mode: bwrap | unshare | none | auto
_UID_BASE = int(os.environ.get("DARE_SANDBOX_UID_BASE", "64000"))
_UID_SLOTS = 256
_WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 5.0  # wall-clock seconds; the whole process tree is killed after it
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    cpu_seconds: Optional[int] = None  # RLIMIT_CPU; default ceil(timeout) + 1
    max_processes: int = 16  # processes/threads the program may add (RLIMIT_NPROC above the current count)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE, largest file the program may write
    open_files: int = 256  # RLIMIT_NOFILE
    max_output: int = 256 << 10  # bytes of stdout+stderr kept; a program writing more is killed


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout | output_limit | error
    returncode: Optional[int]
    output: str
    duration: float
    isolation: str

    @property
    def reason(self) -> Optional[str]:
        """One line saying why the run did not pass (None when it passed)."""
        if self.passed:
            return None
        if self.status != "failed":
            return self.status
        lines = [ln for ln in self.output.strip().splitlines() if ln.strip()]
        return f"failed (exit {self.returncode}): {lines[-1][:200] if lines else 'no output'}"


# Runs inside the sandbox before the program. argv: token fd, then limits, then the program path.
_BOOTSTRAP = r"""
import os, resource, sys
def _boot():
    token = sys.stdin.buffer.readline().strip()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    token_fd, mem, cpu, fsize, nofile, extra = (int(v) for v in sys.argv[1:7])
    path = sys.argv[7]
    uid, running = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                running += os.stat("/proc/" + name).st_uid == uid
            except OSError:
                pass
    for res, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                       (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, running + extra),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    sys.argv = [path]
    namespace = sys.modules["__main__"].__dict__
    del namespace["_boot"]
    namespace["__file__"] = path
    exec(code, namespace)
    os.write(token_fd, token)
_boot()
"""


def _minimal_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": workdir, "TMPDIR": workdir}


def _reachable_by_others(path: str) -> bool:
    """True if a uid that is neither owner nor group member can execute ``path`` (every parent
    directory searchable, the file executable and readable)."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
        if not (mode & stat.S_IXOTH and mode & stat.S_IROTH):
            return False
        parent = os.path.dirname(real)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _interpreter(drop_uid: bool) -> Optional[str]:
    """Python for the sandbox: ours, or (when a dropped uid cannot reach ours, e.g. a pyenv build
    under /root) a system python3. Programs use the standard library only (``-S``)."""
    candidates = [sys.executable, os.path.realpath(sys.executable)]
    if drop_uid:
        candidates += ["/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"]
        candidates = [c for c in candidates if os.path.exists(c) and _reachable_by_others(c)]
    return candidates[0] if candidates else None


# ----------------------------------------------------------------------------------------------
# uid slots (root only)
# ----------------------------------------------------------------------------------------------

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
        os.close(self._fd)


# ----------------------------------------------------------------------------------------------
# launching
# ----------------------------------------------------------------------------------------------

def _wrap(isolation: str, workdir: str, command: list[str]) -> list[str]:
    if isolation == "bwrap":
        wrapper = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                   "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
        if os.path.isdir("/var/tmp"):
            wrapper += ["--tmpfs", "/var/tmp"]
        return wrapper + ["--bind", workdir, workdir, "--chdir", workdir, "--"] + command
    if isolation == "unshare":
        return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
                "--mount-proc", "--"] + command
    if isolation == "none":
        return command
    raise ValueError(f"unknown sandbox isolation {isolation!r}; expected one of {ISOLATIONS}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(source: str, limits: SandboxLimits, isolation: str, drop_uid: bool) -> SandboxResult:
    start = time.monotonic()
    python = _interpreter(drop_uid)
    if python is None:
        raise RuntimeError("no Python interpreter reachable by the sandbox uid (set DARE_SANDBOX_UID_BASE or run as non-root)")
    token = secrets.token_hex(16).encode()
    out_r = out_w = tok_r = tok_w = -1
    proc = slot = workdir = None
    try:
        slot = _UidSlot() if drop_uid else None
        workdir = tempfile.mkdtemp(prefix="dare-sandbox-")
        program = os.path.join(workdir, "program.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        os.chmod(program, 0o644)
        if slot is not None:
            os.chown(workdir, slot.uid, slot.uid)
        out_r, out_w = os.pipe()
        tok_r, tok_w = os.pipe()
        cpu = limits.cpu_seconds or int(math.ceil(limits.timeout)) + 1
        numbers = [tok_w, limits.memory_bytes, cpu, limits.file_bytes, limits.open_files, limits.max_processes]
        command = [python, "-I", "-S", "-c", _BOOTSTRAP] + [str(n) for n in numbers] + [program]
        identity = {"user": slot.uid, "group": slot.uid, "extra_groups": []} if slot is not None else {}
        proc = subprocess.Popen(_wrap(isolation, workdir, command), stdin=subprocess.PIPE, stdout=out_w,
                                stderr=out_w, pass_fds=(tok_w,), cwd=workdir, env=_minimal_env(workdir),
                                start_new_session=True, close_fds=True, **identity)
        os.close(out_w)
        os.close(tok_w)
        out_w = tok_w = -1
        try:
            proc.stdin.write(token + b"\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass
        status, output, received = _collect(proc, out_r, tok_r, limits, start)
        returncode = proc.wait()
        passed = status == "done" and returncode == 0 and received == token
        if status == "done":
            status = "passed" if passed else "failed"
        text = output.decode("utf-8", errors="replace")
        return SandboxResult(passed, status, returncode, text, time.monotonic() - start, isolation)
    finally:
        if proc is not None:
            _kill_group(proc)
            if proc.poll() is None:
                proc.wait()
        for fd in (out_r, out_w, tok_r, tok_w):
            if fd >= 0:
                os.close(fd)
        if slot is not None:
            slot.release()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, out_r: int, tok_r: int, limits: SandboxLimits,
             start: float) -> tuple[str, bytes, bytes]:
    """Read output and the success token until the program exits, the deadline passes or the output
    cap is exceeded (then the process group is killed). Returns (status, output, token bytes)."""
    deadline = start + limits.timeout
    output, received = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(out_r, selectors.EVENT_READ, "out")
    sel.register(tok_r, selectors.EVENT_READ, "tok")
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, "exit")
        except OSError:
            pidfd = None
    open_streams = 2
    status = "done"
    try:
        exited = False
        # Until the program exited and both pipes are drained (a program may close its pipes and
        # keep running, so closed pipes alone do not end the wait).
        while open_streams or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            # After the program exited, its orphans (fallback mode) may keep the pipes open: only
            # drain what is already buffered.
            events = sel.select(0 if exited else min(remaining, 0.05 if pidfd is None else remaining))
            if not events and exited:
                break
            for key, _ in events:
                if key.data == "exit":
                    sel.unregister(pidfd)
                    exited = True
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    open_streams -= 1
                elif key.data == "tok":
                    received += chunk[: 64 - len(received)]
                else:
                    output += chunk
                    if len(output) > limits.max_output:
                        status = "output_limit"
                        del output[limits.max_output:]
                        break
            if status != "done":
                break
            if pidfd is None and not exited and proc.poll() is not None:
                exited = True
        if status != "done":
            _kill_group(proc)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return status, bytes(output), bytes(received)


# ----------------------------------------------------------------------------------------------
# isolation probe
# ----------------------------------------------------------------------------------------------

_probe_lock = threading.Lock()
_probed: dict[str, object] = {}


def _can_drop_uid() -> bool:
    if os.geteuid() != 0 or os.environ.get("DARE_SANDBOX_NO_UID_DROP"):
        return False
    return _interpreter(True) is not None


def _probe(isolation: str, drop_uid: bool) -> bool:
    if isolation == "bwrap" and shutil.which("bwrap") is None:
        return False
    if isolation == "unshare" and shutil.which("unshare") is None:
        return False
    try:
        result = _run("import json, socket\n", SandboxLimits(timeout=20.0), isolation, drop_uid)
    except (OSError, RuntimeError) as err:
        log.info("sandbox isolation %s unavailable: %s", isolation, err)
        return False
    if not result.passed:
        log.info("sandbox isolation %s unavailable: %s", isolation, result.output.strip()[-300:])
    return result.passed


def detect_isolation() -> tuple[str, bool]:
    """(isolation mode, whether runs drop to a dedicated uid), probed once per process.
    ``DARE_SANDBOX_ISOLATION`` forces a mode."""
    with _probe_lock:
        if "mode" not in _probed:
            drop = _can_drop_uid()
            if drop and not _probe("none", True):
                log.warning("cannot run the sandbox as a dedicated uid; running as root (no RLIMIT_NPROC)")
                drop = False
            forced = os.environ.get(_ENV_ISOLATION, "auto")
            if forced not in ISOLATIONS + ("auto",):
                raise ValueError(f"{_ENV_ISOLATION}={forced!r}; expected auto or one of {ISOLATIONS}")
            order = ISOLATIONS if forced == "auto" else (forced,)
            mode = next((m for m in order if m == "none" or _probe(m, drop)), None)
            if mode is None:
                raise RuntimeError(f"{_ENV_ISOLATION}={forced} but that isolation does not work here")
            if mode == "none":
                log.warning("code sandbox: neither bubblewrap nor unshare works; using rlimits + clean "
                            "environment + process-group kill only (no network/file-system isolation)")
            _probed["mode"], _probed["drop"] = mode, drop
        return _probed["mode"], _probed["drop"]  # type: ignore[return-value]


def available_isolations() -> list[str]:
    """Every isolation mode that works on this machine, strongest first (each probed once)."""
    _, drop = detect_isolation()
    with _probe_lock:
        if "available" not in _probed:
            _probed["available"] = [m for m in ISOLATIONS if m == "none" or _probe(m, drop)]
        return list(_probed["available"])  # type: ignore[arg-type]


def run_python(source: str, limits: SandboxLimits = SandboxLimits(), isolation: Optional[str] = None) -> SandboxResult:
    """Run ``source`` as a program in the sandbox. ``isolation=None`` uses the probed best mode;
    naming a mode forces it (tests use ``"none"`` to exercise the fallback)."""
    mode, drop = detect_isolation()
    if isolation is not None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"unknown sandbox isolation {isolation!r}; expected one of {ISOLATIONS}")
        mode = isolation
    try:
        return _run(source, limits, mode, drop)
    except OSError as err:  # e.g. fork failure under memory pressure: a failed run, not a crash
        log.warning("sandbox run failed to start: %s", err)
        return SandboxResult(False, "error", None, f"{type(err).__name__}: {err}", 0.0, mode)


def with_timeout(limits: SandboxLimits, timeout: Optional[float]) -> SandboxLimits:
    """``limits`` with the wall-clock timeout lowered to ``timeout`` (never raised)."""
    if timeout is None or timeout >= limits.timeout:
        return limits
    return dataclasses.replace(limits, timeout=max(0.1, timeout))
