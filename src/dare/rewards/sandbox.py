"""Run untrusted Python (model-written code + its tests) in a contained subprocess.

Every run is a fresh ``python -I -S`` started with ``subprocess.Popen`` (never forked from the
trainer), in a new session, with a minimal environment, in a private temporary directory. A small
bootstrap inside the child sets rlimits (address space, CPU seconds, processes, file size, open
files, no core dumps) and then executes the program. Around that, the strongest available isolation
is used, probed once per process (``detect_isolation``):

``bwrap``    bubblewrap: new user/pid/net/ipc/uts namespaces and the *view* below; the sandbox dies with its
             parent. Network access, writes outside its scratch and processes outliving the program are
             impossible.
``unshare``  util-linux ``unshare``: new user/mount/pid/ipc/net/uts namespaces; the bootstrap builds the same
             view itself and then drops every privilege over it (``sandbox_mounts``).
``none``     the documented fallback: rlimits + clean environment + killing the process group, on the host's
             file system and IPC namespace (as root: its own uid, whose files and IPC objects are removed).

The view (``sandbox_host``): a read-only root holding only the interpreter, the standard library and the shared
libraries it maps; a fresh /proc of the sandbox's pid namespace; /dev's null, zero, full, random, urandom; the program
as read-only /program.py; and the only writable places, a private size-capped tmpfs /tmp (the scratch, cwd, HOME and
TMPDIR) and /dev/shm, gone with the sandbox. SysV IPC objects live in the sandbox's own IPC namespace.

When the scorer runs as root, each run also drops to its own unprivileged uid (a slot from
``DARE_SANDBOX_UID_BASE``, default 64000, 256 slots, locked with ``flock`` across processes): root
ignores RLIMIT_NPROC, and a dedicated uid lets us kill *every* process the program started (even
ones that called ``setsid``) and delete files it left in world-writable directories, in all modes.
Without root and without namespaces (``none`` as an ordinary user) a program that deliberately
signals or writes as that user is not contained: install bubblewrap.

``run_python`` passes a program that ran to its end: the bootstrap writes a random token (given on stdin, never
in argv, environment or files) to a private pipe after the program, so ``os._exit(0)`` before the end fails. A
program can still find that token in its own interpreter, so code rewards use ``run_judged`` instead: the model's
program and the trusted tests run in two sandboxes (two uids as root, two pid namespaces under bwrap/unshare) and
exchange data only; the verdict is the judge's, whose token the program cannot reach.
"""
from __future__ import annotations

import dataclasses
import json
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
from pathlib import Path
from typing import Optional

from .sandbox_host import bwrap_arguments, bwrap_sizes_tmpfs, interpreter_view, unshare_spec
from .sandbox_uids import _UidSlot

log = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "unshare", "none")
_ENV_ISOLATION = "DARE_SANDBOX_ISOLATION"  # force a mode: bwrap | unshare | none | auto


@dataclass(frozen=True)
class SandboxLimits:
    timeout: float = 5.0  # wall-clock seconds; the whole process tree is killed after it
    memory_bytes: int = 1 << 30  # the sample as a whole (a memory cgroup, where the host allows: sandbox_memory) and RLIMIT_AS
    cpu_seconds: Optional[int] = None  # RLIMIT_CPU; default ceil(timeout) + 1
    max_processes: int = 16  # processes/threads the program may add (RLIMIT_NPROC above the current count)
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE, largest file the program may write
    open_files: int = 256  # RLIMIT_NOFILE
    max_output: int = 256 << 10  # bytes of stdout+stderr kept; a program writing more is killed
    scratch_bytes: int = 64 << 20  # size of each private tmpfs (/tmp, /dev/shm) under bwrap/unshare


@dataclass
class SandboxResult:
    passed: bool
    status: str  # passed | failed | timeout | output_limit | memory | error
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


def _child_source() -> str:
    """The in-sandbox bootstrap, passed with ``-c`` (no file the program could edit): ``sandbox_mounts.py`` (the
    unshare view), ``sandbox_wire.py`` (the judge's codec), then ``sandbox_child.py``."""
    global _CHILD_SOURCE
    if _CHILD_SOURCE is None:
        here = Path(__file__).parent
        _CHILD_SOURCE = "\n\n".join((here / name).read_text(encoding="utf-8")
                                     for name in ("sandbox_mounts.py", "sandbox_wire.py", "sandbox_child.py"))
    return _CHILD_SOURCE


_CHILD_SOURCE: Optional[str] = None


def _minimal_env(scratch: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": scratch, "TMPDIR": scratch}


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
# launching
# ----------------------------------------------------------------------------------------------

def _wrap(isolation: str, view, workdir: str, program: Optional[str], limits: SandboxLimits,
          command: list[str]) -> tuple[list[str], dict]:
    """(the full command, the view the bootstrap must build itself: only under unshare)."""
    if isolation == "bwrap":
        return ["bwrap", *bwrap_arguments(view, program, limits.scratch_bytes, bwrap_sizes_tmpfs()), "--"] + command, {}
    if isolation == "unshare":
        root = os.path.join(workdir, "root")
        os.mkdir(root)
        wrapper = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
                   "--kill-child", "--"]
        return wrapper + command, unshare_spec(view, root, program, limits.scratch_bytes)
    if isolation == "none":
        return command, {}
    raise ValueError(f"unknown sandbox isolation {isolation!r}; expected one of {ISOLATIONS}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Launcher:
    """Starts sandboxed children for one run and tears all of them down (processes, uid slots, run folders, our
    pipe ends) on ``close``, whatever happened in between."""

    def __init__(self, limits: SandboxLimits, isolation: str, drop_uid: bool):
        self.limits, self.isolation, self.drop_uid = limits, isolation, drop_uid
        self.python = _interpreter(drop_uid)
        if self.python is None:
            raise RuntimeError("no Python interpreter reachable by the sandbox uid (set DARE_SANDBOX_UID_BASE or run as non-root)")
        self.view = None
        if isolation in ("bwrap", "unshare"):
            self.view = interpreter_view(self.python)
            self.python = self.view.executable  # the real binary, as the view holds it
        self.procs: list[subprocess.Popen] = []
        self.cages: list = []  # sandbox_memory.MemoryCage: one per spawned process tree, where the host allows
        self.fds: list[int] = []
        self.slots: list[_UidSlot] = []
        self.workdirs: list[str] = []

    def pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self.fds += [r, w]
        return r, w

    def close_fd(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.remove(fd)
            os.close(fd)

    def spawn(self, role: str, fd_args: list[int], stdin: bytes, program: Optional[str] = None) -> tuple[subprocess.Popen, int]:
        """Start ``sandbox_child.py ROLE`` with ``fd_args`` (inherited) and the limits; returns (process, the read
        end of its stdout+stderr). Each child gets its own run folder and, as root, its own uid."""
        lim = self.limits
        slot = _UidSlot() if self.drop_uid else None
        if slot is not None:
            self.slots.append(slot)
        # The host folder holds the program (read-only in the view) and, under unshare, the new root's mount point;
        # under bwrap/unshare the program's scratch is a private tmpfs, in the fallback this folder itself.
        workdir = tempfile.mkdtemp(prefix="dare-sandbox-")
        self.workdirs.append(workdir)
        from .sandbox_memory import GATE, memory_cage
        cage = memory_cage(lim.memory_bytes)  # the whole tree's memory; None: RLIMIT_AS per process only
        if cage is not None:
            self.cages.append(cage)
        args = [str(fd) for fd in fd_args]
        cpu = lim.cpu_seconds or int(math.ceil(lim.timeout)) + 1
        # In a cage the cgroup is the bound (and says "memory" when it stops a sample); the per-process address
        # space limit stays, wider, as the line behind it (address space counts mappings never touched).
        address_space = lim.memory_bytes if cage is None else 4 * lim.memory_bytes
        args += [str(n) for n in (address_space, cpu, lim.file_bytes, lim.open_files, lim.max_processes)]
        host_program = None
        if program is not None:
            host_program = os.path.join(workdir, "program.py")
            with open(host_program, "w", encoding="utf-8") as f:
                f.write(program)
            os.chmod(host_program, 0o644)
            args.append(host_program if self.view is None else "/program.py")
        command = [self.python, "-I", "-S", "-c", _child_source(), role] + args
        full, view_spec = _wrap(self.isolation, self.view, workdir, host_program, lim, command)
        if cage is not None:
            full = GATE + full  # waits for one line: the launcher moves it into the cage first
        if slot is not None:
            for path in (workdir, *([view_spec["root"]] if view_spec else [])):
                os.chown(path, slot.uid, slot.uid)
        out_r, out_w = self.pipe()
        identity = {"user": slot.uid, "group": slot.uid, "extra_groups": []} if slot is not None else {}
        scratch = workdir if self.view is None else "/tmp"
        proc = subprocess.Popen(full, stdin=subprocess.PIPE, stdout=out_w, stderr=out_w, pass_fds=tuple(fd_args),
                                cwd=workdir, env=_minimal_env(scratch), start_new_session=True, close_fds=True, **identity)
        self.procs.append(proc)
        self.close_fd(out_w)
        gate = b""
        if cage is not None:
            try:
                cage.add(proc.pid)
                gate = b"go\n"
            except OSError as e:  # never let it run outside its cage
                _kill_group(proc)
                raise OSError(f"could not move the sandbox process into its memory cgroup {cage.path}: {e}") from e
        try:  # first line: the view the bootstrap builds (unshare) or null; then the role's own input
            proc.stdin.write(gate + json.dumps(view_spec or None).encode() + b"\n" + stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        return proc, out_r

    def close(self) -> None:
        for proc in self.procs:
            _kill_group(proc)
            if proc.poll() is None:
                proc.wait()
        for fd in list(self.fds):
            self.close_fd(fd)
        for cage in self.cages:
            cage.close()
        for slot in self.slots:
            slot.release()
        for workdir in self.workdirs:
            shutil.rmtree(workdir, ignore_errors=True)


def _verdict(launcher: _Launcher, proc, streams: dict[int, str], token: bytes, start: float) -> SandboxResult:
    """Wait for ``proc`` (the process whose success counts), collect ``streams`` and build the result: passed only
    when it exited 0 after writing ``token`` on its private pipe (label ``"tok"``)."""
    status, outputs = _collect(proc, streams, launcher.limits, start)
    returncode = proc.wait()
    passed = status == "done" and returncode == 0 and outputs.get("tok", b"") == token
    if status == "done":
        status = "passed" if passed else "failed"
    if not passed and any(cage.oom_killed() for cage in launcher.cages):
        status = "memory"  # the sample as a whole passed limits.memory_bytes (sandbox_memory)
    text = b"".join(v for k, v in outputs.items() if k != "tok").decode("utf-8", errors="replace")
    return SandboxResult(passed, status, returncode, text, time.monotonic() - start, launcher.isolation)


def _run(source: str, limits: SandboxLimits, isolation: str, drop_uid: bool) -> SandboxResult:
    """One program; passed = it ran to its end (the bootstrap writes the token after it)."""
    start = time.monotonic()
    launcher = _Launcher(limits, isolation, drop_uid)
    try:
        token = secrets.token_hex(16).encode()
        tok_r, tok_w = launcher.pipe()
        proc, out_r = launcher.spawn("run", [tok_w], token + b"\n", program=source)
        launcher.close_fd(tok_w)
        return _verdict(launcher, proc, {out_r: "out", tok_r: "tok"}, token, start)
    finally:
        launcher.close()


def _run_judged(program: str, spec: dict, limits: SandboxLimits, isolation: str, drop_uid: bool) -> SandboxResult:
    """The candidate ``program`` in one sandbox, the trusted tests (``spec``) in another; they talk through two
    pipes, in data only. Passed = the judge ran every test and wrote its token, which the candidate cannot reach."""
    start = time.monotonic()
    launcher = _Launcher(limits, isolation, drop_uid)
    try:
        token = secrets.token_hex(16).encode()
        req_r, req_w = launcher.pipe()
        resp_r, resp_w = launcher.pipe()
        tok_r, tok_w = launcher.pipe()
        cand, cand_out = launcher.spawn("candidate", [req_r, resp_w], b"", program=program)
        launcher.close_fd(req_r)
        launcher.close_fd(resp_w)
        judge, judge_out = launcher.spawn("judge", [tok_w, req_w, resp_r], token + b"\n" + json.dumps(spec).encode())
        for fd in (tok_w, req_w, resp_r):
            launcher.close_fd(fd)
        return _verdict(launcher, judge, {cand_out: "candidate", judge_out: "judge", tok_r: "tok"}, token, start)
    finally:
        launcher.close()


def _collect(proc: subprocess.Popen, streams: dict[int, str], limits: SandboxLimits,
             start: float) -> tuple[str, dict[str, bytes]]:
    """Read every stream (``{fd: label}``; ``"tok"`` is the token pipe, the others are output) until ``proc`` exits,
    the deadline passes or the output cap is exceeded (then ``proc``'s process group is killed).
    Returns (status, {label: bytes}) with labels in the order given."""
    deadline = start + limits.timeout
    outputs = {label: bytearray() for label in streams.values()}
    sel = selectors.DefaultSelector()
    for fd, label in streams.items():
        sel.register(fd, selectors.EVENT_READ, label)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            sel.register(pidfd, selectors.EVENT_READ, None)
        except OSError:
            pidfd = None
    open_streams = len(streams)
    status = "done"
    try:
        exited = False
        # Until the process exited and the pipes are drained (a program may close its pipes and keep running, so
        # closed pipes alone do not end the wait).
        while open_streams or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            # After it exited, orphans (fallback mode) or a still-running partner may keep pipes open: only drain
            # what is already buffered.
            events = sel.select(0 if exited else min(remaining, 0.05 if pidfd is None else remaining))
            if not events and exited:
                break
            for key, _ in events:
                if key.data is None:
                    sel.unregister(pidfd)
                    exited = True
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    open_streams -= 1
                elif key.data == "tok":
                    outputs["tok"] += chunk[: 64 - len(outputs["tok"])]
                else:
                    outputs[key.data] += chunk
                    excess = sum(len(v) for k, v in outputs.items() if k != "tok") - limits.max_output
                    if excess > 0:
                        status = "output_limit"
                        del outputs[key.data][len(outputs[key.data]) - excess:]
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
    return status, {k: bytes(v) for k, v in outputs.items()}


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
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        result, why = None, str(err)
    else:
        why = result.output.strip()[-300:]
    if result is None or not result.passed:
        # Installed but not working (no user namespaces, a view this system cannot build): a weaker mode is used,
        # so say so loudly.
        level = logging.INFO if isolation == "none" else logging.WARNING
        log.log(level, "sandbox isolation %s is installed but does not work here (a weaker mode will be used): %s",
                isolation, why)
        return False
    return True


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


def _mode(isolation: Optional[str]) -> tuple[str, bool]:
    mode, drop = detect_isolation()
    if isolation is not None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"unknown sandbox isolation {isolation!r}; expected one of {ISOLATIONS}")
        mode = isolation
    return mode, drop


def _guarded(run, mode: str) -> SandboxResult:
    try:
        return run()
    except OSError as err:  # e.g. fork failure under memory pressure: a failed run, not a crash
        log.warning("sandbox run failed to start: %s", err)
        return SandboxResult(False, "error", None, f"{type(err).__name__}: {err}", 0.0, mode)


def run_python(source: str, limits: SandboxLimits = SandboxLimits(), isolation: Optional[str] = None) -> SandboxResult:
    """Run ``source`` as a program in the sandbox; ``passed`` = it ran to its end with status 0. ``isolation=None``
    uses the probed best mode; naming a mode forces it (tests use ``"none"`` to exercise the fallback).

    The verdict comes from the program's own process, so a program that introspects the interpreter can fake it:
    use ``run_judged`` to score code against tests."""
    mode, drop = _mode(isolation)
    return _guarded(lambda: _run(source, limits, mode, drop), mode)


def run_judged(program: str, tests: str, entry_point: Optional[str] = None, prefix: str = "",
               limits: SandboxLimits = SandboxLimits(), isolation: Optional[str] = None) -> SandboxResult:
    """Score ``program`` against ``tests`` without trusting anything it does: the program runs alone in one sandbox;
    ``prefix`` (trusted task code, e.g. HumanEval's prompt) and ``tests`` run in a second one, the *judge*, where
    every name the tests take from the program is a proxy whose calls and results cross as data (exact builtin
    types, see ``sandbox_child``). ``passed`` = the judge ran every test; its proof never enters the program's process."""
    mode, drop = _mode(isolation)
    spec = {"tests": tests, "entry_point": entry_point, "prefix": prefix}
    return _guarded(lambda: _run_judged(program, spec, limits, mode, drop), mode)


def with_timeout(limits: SandboxLimits, timeout: Optional[float]) -> SandboxLimits:
    """``limits`` with the wall-clock timeout lowered to ``timeout`` (never raised)."""
    if timeout is None or timeout >= limits.timeout:
        return limits
    return dataclasses.replace(limits, timeout=max(0.1, timeout))
