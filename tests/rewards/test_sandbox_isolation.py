"""The sandbox's view, part of the hostile battery (every case in every isolation mode that works here): nothing a
sample leaves behind (SysV IPC, files in any writable place) survives it or reaches another sample, and a candidate
sees the interpreter and the standard library only: no answers, no host files, no host processes.

Each hostile program would pass its test if it escaped (``escaped()`` is True), so reward 0 is the evidence; the host
side (IPC objects, files) is checked directly as well.
"""
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import dare
from dare.rewards import SandboxLimits, run_judged
from tests.rewards.sandbox_battery import (
    ESCAPED, HOSTILE_LIMITS, HUMANEVAL, assert_nothing_left, assert_sandbox_still_works, code, example,
    needs_containment,
)

ROOT = Path(__file__).resolve().parents[2]
PASSES = example("assert f() == 1")
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"


def no_file_system_isolation(mode):
    if mode == "none":
        pytest.skip("the fallback has no file-system or pid namespace (documented): it shares the host's view")


def host_ipc_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                keys.update(int(line.split()[0]) for line in f.readlines()[1:] if line.split())
        except OSError:
            pass
    return keys


# ------------------------------------------------------------------------------------------------ IPC
def test_sysv_ipc_does_not_outlive_the_sample(mode):
    needs_containment(mode, "IPC objects of our own user")
    key = random.randrange(0x5DA00000, 0x5DAFFFFF)
    writer = LIBC + f"""
KEY = {key}
shm = libc.shmget(KEY, 1 << 20, 0o1666)   # IPC_CREAT | 0666
if shm >= 0:
    addr = libc.shmat(shm, None, 0)
    ctypes.memmove(addr, b"message-from-sample-1", 21)
    libc.shmdt(ctypes.c_void_p(addr))
libc.msgget(KEY, 0o1666)
libc.semget(KEY, 1, 0o1666)
made = shm >= 0
def f():
    return 1 if made else 0
"""
    reader = LIBC + f"""
KEY = {key}
found = []
shm = libc.shmget(KEY, 0, 0)
if shm >= 0:
    addr = libc.shmat(shm, None, 0)
    found.append(ctypes.string_at(addr, 21) if addr not in (None, ctypes.c_void_p(-1).value) else b"shm")
found += [kind for kind, ident in (("msg", libc.msgget(KEY, 0)), ("sem", libc.semget(KEY, 0, 0))) if ident >= 0]
def escaped():
    return bool(found)
"""
    assert code(writer, PASSES) == 1.0  # the writer really made its objects (shmget works in the sandbox)
    assert key not in host_ipc_keys(), "a sandbox's SysV IPC object outlived it"
    assert code(reader, ESCAPED) == 0.0
    assert key not in host_ipc_keys()
    assert_nothing_left()


# ------------------------------------------------------------------------------------------------ files
WRITABLE_PLACES = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/run", "/var", "/", "~", "."]


def test_files_a_sample_leaves_anywhere_do_not_survive_it(mode):
    needs_containment(mode, "files of our own user")
    tag = f"dare-leftover-{uuid.uuid4().hex}"
    writer = f"""
import os
wrote = []
for place in {WRITABLE_PLACES!r}:
    path = os.path.join(os.path.expanduser(place), {tag!r})
    try:
        with open(path, "w") as f:
            f.write("left behind")
        wrote.append(path)
    except OSError:
        pass
print("wrote", wrote)
def f():
    return 1 if wrote else 0
"""
    reader = f"""
import os
found = [p for p in {WRITABLE_PLACES!r} if os.path.exists(os.path.join(os.path.expanduser(p), {tag!r}))]
def escaped():
    return bool(found)
"""
    assert code(writer, PASSES) == 1.0  # it found somewhere to write (its scratch)
    leftover = [p for p in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/run", "/var", "/")
                if os.path.exists(os.path.join(p, tag))]
    assert leftover == [], f"files outlived the sample in {leftover}"
    assert code(reader, ESCAPED) == 0.0


def test_the_scratch_is_private_and_starts_empty(mode):
    """Two samples at once: the second must not read what the first wrote in its /tmp, and every sample starts with an
    empty working directory."""
    needs_containment(mode, "files of our own user")
    tag = uuid.uuid4().hex
    limits = SandboxLimits(timeout=20.0, memory_bytes=256 << 20, max_processes=12)  # generous: on a loaded CI
    # machine the first sample (a 2.5 s sleep) timed out at 6 s once; the test is about isolation, not speed
    first = f"""
import os, tempfile, time
for place in ("/tmp", tempfile.gettempdir(), "."):
    try:
        with open(os.path.join(place, "shared-{tag}"), "w") as f:
            f.write("secret-of-the-first-sample")
    except OSError:
        pass
time.sleep(2.5)
def f():
    return 1
"""
    second = f"""
import glob, os, tempfile, time
seen, deadline = [], time.time() + 2.0
while not seen and time.time() < deadline:
    for path in glob.glob("/tmp/**/shared-{tag}", recursive=True) + glob.glob("/tmp/shared-{tag}"):
        try:
            with open(path) as f:
                seen.append(f.read())
        except OSError:
            pass
    time.sleep(0.05)
own = [n for n in os.listdir(".") if n != "program.py"] + [n for n in os.listdir(tempfile.gettempdir()) if n != "program.py"]
def escaped():
    return "secret-of-the-first-sample" in seen or bool(own)
"""
    results = {}
    threads = [threading.Thread(target=lambda: results.setdefault("first", run_judged(first, "assert f() == 1\n",
                                                                                        limits=limits, isolation=mode)))]
    threads[0].start()
    time.sleep(0.5)
    results["second"] = run_judged(second, "assert escaped() is True\n", limits=limits, isolation=mode)
    threads[0].join()
    assert results["first"].passed, results["first"].output[-500:]
    second = results["second"]
    assert not second.passed, "a sample read another's scratch, or its scratch was not empty"
    assert second.reason.endswith("AssertionError"), second.output[-500:]  # it ran, and found nothing


def test_the_scratch_is_capped(mode):
    no_file_system_isolation(mode)
    from dare.rewards.sandbox_host import bwrap_sizes_tmpfs
    if mode == "bwrap" and not bwrap_sizes_tmpfs():
        pytest.skip("this bubblewrap has no --size: its scratch tmpfs is not capped (documented)")
    limits = SandboxLimits(timeout=10.0, memory_bytes=256 << 20, scratch_bytes=8 << 20)
    program = """
import os
written = 0
for place in ("/tmp", "/dev/shm"):
    for i in range(64):
        try:
            with open(os.path.join(place, f"fill-{i}"), "wb") as f:
                f.write(b"x" * (1 << 20))
            written += 1 << 20
        except OSError:
            break
print("written", written, flush=True)
def escaped():
    return written > 2 * (8 << 20) + (1 << 20)
"""
    result = run_judged(program, "assert escaped() is True\n", limits=limits, isolation=mode)
    assert not result.passed and "written" in result.output, result.output[-500:]


# ------------------------------------------------------------------------------------------------ the view
def test_the_candidate_sees_no_answers_and_no_host_files(mode, tmp_path):
    no_file_system_isolation(mode)
    tag = uuid.uuid4().hex
    planted = Path("/tmp") / f"dare-answers-{tag}"
    planted.mkdir()
    (planted / "mbpp_train.jsonl").write_text(f'{{"tests": ["assert f() == {tag!r}"]}}\n')
    home = os.path.expanduser("~")
    program = f"""
import glob, gzip, os, sys
found = []
def attempt(what, fn):
    try:
        if fn():
            found.append(what)
    except Exception:
        pass
attempt("bundled HumanEval", lambda: gzip.open({str(HUMANEVAL)!r}).read(100))
attempt("dare package", lambda: os.listdir({str(Path(dare.__file__).parent)!r}))
attempt("planted answers in /tmp", lambda: glob.glob("/tmp/**/*.jsonl", recursive=True))
attempt("working directory", lambda: open({str(ROOT / 'README.md')!r}).read(10))
# (an interpreter installed under the home directory, e.g. pyenv's, brings the folders on its own path, nothing else)
attempt("home", lambda: [n for n in os.listdir({home!r}) if not sys.executable.startswith(os.path.join({home!r}, n))])
attempt("/etc", lambda: open("/etc/passwd").read(10) or os.listdir("/etc"))
attempt("site-packages", lambda: glob.glob("/usr/lib/python3*/*-packages/*") + glob.glob("/usr/local/lib/python3*/*-packages/*")
        + glob.glob({sys.prefix!r} + "/lib/python3*/site-packages/*"))
attempt("/sys", lambda: os.listdir("/sys"))
attempt("/home", lambda: os.listdir("/home"))
print("found", found)
def escaped():
    return bool(found)
"""
    try:
        result = run_judged(program, "assert escaped() is True\n", limits=HOSTILE_LIMITS, isolation=mode)
        assert not result.passed, result.output[-800:]
        assert "found []" in result.output
    finally:
        for child in planted.iterdir():
            child.unlink()
        planted.rmdir()


STDLIB_PROGRAM = """
import array, bisect, collections, ctypes, dataclasses, datetime, decimal, fractions, functools, hashlib, heapq
import itertools, json, math, operator, random, re, statistics, string, struct, sys, typing, unicodedata, zlib
import bz2, lzma, csv, io, textwrap, copy, enum, time, tempfile, os
def f():
    checks = [math.isclose(math.pi, 3.14159, rel_tol=1e-5), re.sub("a", "b", "aa") == "bb",
              json.loads("[1]") == [1], hashlib.sha256(b"x").hexdigest()[:4] == "2d71",
              decimal.Decimal("0.1") + decimal.Decimal("0.2") == decimal.Decimal("0.3"),
              unicodedata.name("a") == "LATIN SMALL LETTER A", zlib.decompress(zlib.compress(b"z")) == b"z",
              bz2.decompress(bz2.compress(b"b")) == b"b", lzma.decompress(lzma.compress(b"l")) == b"l",
              ctypes.sizeof(ctypes.c_int) == 4, heapq.nsmallest(1, [3, 1]) == [1]]
    with tempfile.TemporaryDirectory() as d:          # the scratch is writable
        with open(os.path.join(d, "x"), "w") as fh:
            fh.write("ok")
        checks.append(open(os.path.join(d, "x")).read() == "ok")
    return all(checks)
"""


def test_the_view_holds_the_standard_library(mode):
    assert code(STDLIB_PROGRAM, example("assert f() is True")) == 1.0


def test_proc_shows_the_sandbox_only_even_after_unmounting_it(mode):
    no_file_system_isolation(mode)
    secret = f"argv-secret-{uuid.uuid4().hex}"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", secret])
    program = LIBC + f"""
import os
SECRET = {secret[::-1]!r}[::-1]   # reversed: the secret is not in this program's own text
for flags in (2, 0):              # MNT_DETACH, then a plain unmount
    libc.umount2(b"/proc", flags)
seen = []
for root in ("/proc", "/proc/1/root/proc"):
    try:
        pids = os.listdir(root)
    except OSError:
        continue
    for pid in pids:
        try:
            with open(os.path.join(root, pid, "cmdline"), "rb") as fh:
                if SECRET.encode() in fh.read():
                    seen.append(pid)
        except OSError:
            pass
def escaped():
    return bool(seen)
"""
    try:
        deadline = time.monotonic() + 5
        while secret.encode() not in Path(f"/proc/{bystander.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert code(program, ESCAPED) == 0.0
    finally:
        bystander.kill()
        bystander.wait()
    assert_nothing_left()
    assert_sandbox_still_works()


def test_no_secret_is_on_any_command_line(mode, monkeypatch):
    """The judge's token and the tests reach the sandbox on stdin: a host process reading every command line (what a
    fallback sandbox, or anyone on the machine, can read) finds neither."""
    token = "5ec7e7" * 5 + "00"
    monkeypatch.setattr("dare.rewards.sandbox.secrets.token_hex", lambda n: token)
    seen, stop = [], threading.Event()

    def scan():
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if token.encode() in cmdline or b"expected-answer-7d1" in cmdline:
                    seen.append(pid)
            time.sleep(0.01)

    scanner = threading.Thread(target=scan)
    scanner.start()
    try:
        result = run_judged("import time\ntime.sleep(1.0)\ndef f():\n    return 1\n",
                            "assert f() == 1  # expected-answer-7d1\n", limits=HOSTILE_LIMITS, isolation=mode)
    finally:
        stop.set()
        scanner.join()
    assert result.passed and seen == []
