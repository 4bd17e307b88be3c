"""The code sandbox: correct programs pass, and a battery of hostile programs is contained.

Every hostile program is written so that it would *pass* its tests (reward 1) if it escaped, so
reward 0 is evidence of containment; the side effects (files, connections, leftover processes, the
test process itself) are checked directly as well. The battery runs once per isolation mode that
works here, including the forced fallback ``none`` (rlimits + clean env + process-group kill).
"""
import dataclasses
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dare.rewards import (
    SandboxLimits, build_program, detect_isolation, extract_code, run_code, run_python, set_code_limits,
)
from dare.rewards import sandbox_memory
from dare.rewards.sandbox_uids import _UID_BASE, _UID_SLOTS

from tests.rewards.sandbox_battery import (
    ESCAPED, HOSTILE_LIMITS, HUMANEVAL, IS_ROOT, MODES, assert_nothing_left, assert_sandbox_still_works, code, example,
    needs_containment,
)


# ------------------------------------------------------------------------------------ correct programs
def humaneval_problems(n: int) -> list[dict]:
    with gzip.open(HUMANEVAL, "rt") as f:
        return [json.loads(line) for line, _ in zip(f, range(n))]


def humaneval_example(problem: dict) -> dict:
    return {"task": "humaneval", "ground_truth": {"tests": problem["test"], "entry_point": problem["entry_point"],
                                                  "prefix": problem["prompt"]}}


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(mode):
    set_code_limits(SandboxLimits(timeout=10.0), mode)
    for problem in humaneval_problems(3):
        ex = humaneval_example(problem)
        assert code(problem["canonical_solution"], ex) == 1.0                          # raw body continuation
        fenced = f"Here you go:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
        assert code(fenced, ex) == 1.0                                                 # full function in a block
        assert code("    return None\n", ex) == 0.0


def test_mbpp_style_assert_list(mode):
    tests = json.dumps(["assert remove_Occ(\"hello\",\"l\") == \"heo\"", "assert remove_Occ(\"abcda\",\"a\") == \"bcd\"",
                        "assert remove_Occ(\"PHP\",\"P\") == \"H\""])
    good = "```python\ndef remove_Occ(s, ch):\n    return s.replace(ch, '', 1)[::-1].replace(ch, '', 1)[::-1]\n```"
    wrong = "```python\ndef remove_Occ(s, ch):\n    return s.replace(ch, '', 1)\n```"
    assert code(good, example(tests)) == 1.0
    assert code(wrong, example(tests)) == 0.0


def test_exit_before_tests_is_not_a_pass(mode):
    for trick in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "raise SystemExit(0)\n",
                  "import os\nos.close(1)\nos.close(2)\n"):
        assert code(trick + "def f():\n    return 0\n", example("assert f() == 1")) == 0.0, trick


# ------------------------------------------------------------------------------------ hostile programs
def test_infinite_loop_is_killed_at_the_timeout(mode):
    silent = "import os\nfor fd in range(1, 64):\n    try:\n        os.close(fd)\n    except OSError:\n        pass\n"
    for program in ("while True:\n    pass\n", silent + "while True:\n    pass\n"):  # the second closes its pipes
        start = time.monotonic()
        result = run_python(program, HOSTILE_LIMITS, mode)
        assert result.status == "timeout" and not result.passed
        assert time.monotonic() - start < HOSTILE_LIMITS.timeout + 2
    assert_nothing_left()


def test_fork_bomb(mode):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    bomb = f"""
import os, time
MARK = {marker!r}
started = 0
deadline = time.time() + 1.5
while time.time() < deadline:
    try:
        if os.fork() == 0:
            started = 0
        else:
            started += 1
    except OSError:
        time.sleep(0.01)
def escaped():
    return started > 1000
"""
    assert code(bomb, ESCAPED) == 0.0
    assert_nothing_left(marker)
    assert_sandbox_still_works()


def test_memory_bomb(mode):
    bomb = """
import mmap
try:
    reserved = mmap.mmap(-1, 4 << 30)   # address space beyond the limit
    big = True
except (OSError, MemoryError, OverflowError):
    big = False
blocks = []
try:
    while len(blocks) < 64:
        blocks.append(bytearray(64 << 20))  # really touch memory, 4 GiB in total
    filled = True
except MemoryError:
    filled = False
def escaped():
    return big or filled
"""
    assert code(bomb, ESCAPED) == 0.0
    # The limit under test is memory, not time: a generous wall clock keeps a loaded CI machine (where this once ran
    # into the hostile 2 s with no output) from turning it into a timeout. The program stops at 1 GiB, so an
    # unenforced limit passes (and fails the assertion) instead of eating the machine.
    patient = dataclasses.replace(HOSTILE_LIMITS, timeout=15.0)
    result = run_python("blocks = []\nfor _ in range(64):\n    blocks.append(bytearray(16 << 20))\n", patient, mode)
    if sandbox_memory.available():  # the sample's memory cgroup stops it (SIGKILL) before its address space limit
        assert not result.passed and result.status == "memory", (result.status, result.duration, result.output[-300:])
    else:
        assert not result.passed and "MemoryError" in result.output, (result.status, result.duration)
    assert_nothing_left()


def test_daemonised_children_do_not_outlive_the_program(mode):
    marker = f"daemon-{uuid.uuid4().hex}"
    program = f"""
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)", {marker!r}],
                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:          # classic double fork: a session leader's orphan spinning forever
    os.setsid()
    if os.fork() == 0:
        while True:
            pass
    os._exit(0)
time.sleep(0.2)
def f():
    return 1
"""
    # The program itself is correct, so it passes: what matters is that nothing it started survives.
    assert code(program, example("assert f() == 1")) == 1.0
    assert_nothing_left(marker)


def test_no_network(mode):
    if mode == "none":
        pytest.skip("the fallback has no network namespace (documented); bwrap/unshare cut the network")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.setblocking(False)
    port = server.getsockname()[1]
    program = f"""
import socket
reached = []
for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 80), ("pypi.org", 443)):
    try:
        socket.create_connection((host, port), timeout=1.0).close()
        reached.append(host)
    except OSError:
        pass
def escaped():
    return bool(reached)
"""
    try:
        assert code(program, ESCAPED) == 0.0
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to the test's listener
    finally:
        server.close()


def test_no_writes_outside_the_run_directory(mode, tmp_path):
    needs_containment(mode, "file writes")
    tag = uuid.uuid4().hex
    targets = [tmp_path / f"escape-{tag}", Path("/tmp") / f"dare-escape-{tag}", Path(__file__).parent / f"escape-{tag}"]
    if os.path.isdir("/dev/shm"):
        targets.append(Path("/dev/shm") / f"dare-escape-{tag}")
    program = f"""
written = []
for path in {[str(t) for t in targets]!r}:
    try:
        with open(path, "w") as f:
            f.write("owned")
        written.append(path)
    except OSError:
        pass
def escaped():
    return False   # even a program that believes it wrote must leave nothing behind
"""
    try:
        assert code(program, ESCAPED) == 0.0
        for target in targets:
            assert not target.exists(), f"the sandbox wrote {target}"
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def _environ_has(pid: int, secret: str) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return secret.encode() in f.read()


def test_environment_secrets_are_invisible(mode, monkeypatch):
    needs_containment(mode, "reading our environment through /proc")
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("DARE_TEST_SECRET", secret)
    # /proc/<pid>/environ shows a process's environment as it started, so a bystander started with
    # the secret (like a trainer started with HF_TOKEN) is what a snooping program could read.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    program = f"""
import os
SECRET = {secret[::-1]!r}[::-1]   # reversed so the secret is not in this program's own text
found = [k for k, v in os.environ.items() if SECRET in v]
for pid in os.listdir("/proc"):
    try:
        with open("/proc/" + pid + "/environ", "rb") as f:
            if SECRET.encode() in f.read():
                found.append(pid)
    except OSError:
        pass
def escaped():
    return bool(found)
"""
    try:
        deadline = time.monotonic() + 5
        while not _environ_has(bystander.pid, secret) and time.monotonic() < deadline:
            time.sleep(0.02)  # until the bystander has exec'd
        assert _environ_has(bystander.pid, secret)  # the secret really is there to be found
        assert code(program, ESCAPED) == 0.0
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()
    result = run_python("import os\nprint(sorted(os.environ))\n", HOSTILE_LIMITS, mode)
    assert result.passed and "DARE_TEST_SECRET" not in result.output and secret not in result.output


def test_killing_the_parent_and_everything_else(mode):
    needs_containment(mode, "signals sent as our own user")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    program = """
import os, signal, time
parent = os.getppid()
for target in (parent, -1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
time.sleep(0.3)
def escaped():
    return os.getppid() != parent
"""
    try:
        assert code(program, ESCAPED) == 0.0
        assert bystander.poll() is None, "the sandbox killed a process outside it"
        assert_sandbox_still_works()
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()
    assert_nothing_left()


def test_huge_output_is_capped(mode):
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    result = run_python(program, HOSTILE_LIMITS, mode)
    assert result.status == "output_limit" and not result.passed
    assert len(result.output) <= HOSTILE_LIMITS.max_output
    assert code(program + "def escaped():\n    return True\n", ESCAPED) == 0.0
    assert_nothing_left()


# ------------------------------------------------------------------------------------ reward hacks
# An RL policy that finds one of these is rewarded for wrong code: the test is HumanEval-style and the correct
# answer is 3, so every program below would score 1.0 under a harness that runs tests and code in one process.
ADD = {"task": "humaneval", "ground_truth": {"tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
                                             "entry_point": "add", "prefix": "def add(a, b):\n"}}
TOKEN_FORGER = """    return 0
import gc, os, sys
def _forge():
    # Whatever proves success must be in this interpreter: bytes that look like a token, and descriptors to send
    # them on. Try every combination, then leave before any test can fail.
    tokens = set()
    frame = sys._getframe()
    while frame is not None:
        tokens.update(v for v in frame.f_locals.values() if type(v) is bytes and 16 <= len(v) <= 64)
        frame = frame.f_back
    tokens.update(o for o in gc.get_objects() if type(o) is bytes and 16 <= len(o) <= 64)
    for fd in sorted(int(n) for n in os.listdir("/proc/self/fd")):
        for token in tokens:
            try:
                os.write(fd, token)
            except OSError:
                pass
    os._exit(0)
_forge()
"""
REWARD_HACKS = {
    "always-equal object": "    class Anything:\n        def __eq__(self, other):\n            return True\n    return Anything()\n",
    "int subclass with a rigged __eq__": "    class Three(int):\n        def __eq__(self, other):\n            return True\n"
                                         "        __hash__ = int.__hash__\n    return Three(0)\n",
    "stack-walking token forger + os._exit(0)": TOKEN_FORGER,
}


@pytest.mark.parametrize("hack", sorted(REWARD_HACKS))
def test_reward_hacks_score_zero(mode, hack):
    from dare.rewards import score_batch
    assert code("    return a + b\n", ADD) == 1.0                    # the honest answer passes in this mode
    result = score_batch("code", [REWARD_HACKS[hack]], [ADD], workers=0)[0]
    assert result.score == 0.0, hack
    assert_nothing_left()


# Candidate objects in shapes other than ``==``: each program below is wrong but scored 1.0 when the judge resolved a
# name in the candidate, ran a method of a returned object in the candidate, or re-raised its StopIteration.
TRUSTED_SHAPES = {
    "math defined by the candidate (tests use math.isclose without importing it)": (
        example("assert math.isclose(area(2), 12.566370614359172, rel_tol=1e-9)\n"),
        "import math\ndef area(r):\n    return math.pi * r * r\n",
        "class _Lenient:\n    def isclose(self, *args, **kwargs):\n        return True\nmath = _Lenient()\n"
        "def area(r):\n    return 0\n"),
    "a method called on the returned value": (
        {"task": "humaneval", "ground_truth": {"tests": "def check(candidate):\n    assert candidate('hello').startswith('olleh')\n",
                                               "entry_point": "rev", "prefix": ""}},
        "def rev(s):\n    return s[::-1]\n",
        "class _Yes:\n    def startswith(self, *args):\n        return True\ndef rev(s):\n    return _Yes()\n"),
    "StopIteration inside all(map(...))": (
        example("assert all(map(lambda p: add(*p) == p[0] + p[1], [(1, 2), (3, 4)]))\n"),
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    raise StopIteration\n"),
    "StopIteration inside a for loop over map": (
        example("for ok in map(lambda p: add(*p) == p[0] + p[1], [(1, 2), (3, 4)]):\n    assert ok\nassert add(5, 6) == 11\n"),
        "def add(a, b):\n    return a + b\n",
        "calls = []\ndef add(a, b):\n    calls.append(1)\n    if len(calls) == 1:\n        raise StopIteration\n    return a + b\n"),
    "a module of the candidate's choosing imported by the judge": (
        example("assert add(1, 2) == 3\n"),
        "def add(a, b):\n    return a + b\n",
        "import types\nadd = types.ModuleType('this')\n"),
}


@pytest.mark.parametrize("shape", sorted(TRUSTED_SHAPES))
def test_the_judge_trusts_no_candidate_object(mode, shape):
    ex, honest, hostile = TRUSTED_SHAPES[shape]
    assert code(honest, ex) == 1.0
    result = run_code(hostile, ex)
    assert not result.passed, shape
    assert "Beautiful is better than ugly" not in result.output  # `import this` never ran in the judge
    assert_nothing_left()


def test_bundled_mbpp_356_builds_its_trees_in_the_tests(mode):
    # The bundled row had lost MBPP's test_setup_code, so the candidate supplied root, root1 and root2 itself.
    from dare.data import DataConfig, load_examples
    row = next(e for e in load_examples(DataConfig(name="mbpp", split="test")) if e["id"] == "mbpp/test/356")
    node = "class Node:\n    def __init__(self, data):\n        self.data, self.left, self.right = data, None, None\n"
    honest = (node + "def height(n):\n    return 0 if n is None else 1 + max(height(n.left), height(n.right))\n"
              "def is_tree_balanced(root):\n    if root is None:\n        return True\n"
              "    return (abs(height(root.left) - height(root.right)) <= 1 and is_tree_balanced(root.left)\n"
              "            and is_tree_balanced(root.right))\n")
    own_trees = node + "root, root1, root2 = 0, 1, 0\ndef is_tree_balanced(r):\n    return r == 1\n"
    assert code(honest, row) == 1.0
    assert code(own_trees, row) == 0.0


def test_a_sandbox_timeout_is_reported_as_a_timeout(mode):
    from dare.rewards import score_batch
    looping = "def f():\n    while True:\n        pass\n"
    results = score_batch("code", [looping, "def f():\n    return 1\n"], [example("assert f() == 1")] * 2, timeout=1.5)
    assert [(r.score, r.reason) for r in results] == [(0.0, "timeout"), (1.0, None)]


# ------------------------------------------------------------------------------------------ plumbing
def test_detected_mode_is_the_strongest_available():
    mode, _ = detect_isolation()
    assert MODES[-1] == "none"
    assert mode == os.environ.get("DARE_SANDBOX_ISOLATION", MODES[0])
    if IS_ROOT:
        # As root every run drops to a dedicated uid (RLIMIT_NPROC does not bind root).
        result = run_python("import os\nprint(os.getuid())\n", SandboxLimits(timeout=10), "none")
        assert result.passed and _UID_BASE <= int(result.output.split()[-1]) < _UID_BASE + _UID_SLOTS


def test_code_extraction_and_program_assembly():
    assert extract_code("```python\nx = 1\n```\n```python\ndef f():\n    pass\n```", "f") == "def f():\n    pass\n"
    assert extract_code("```py\nfirst = 1\n```\n```\nsecond = 2\n```") == "first = 1\n"
    assert extract_code("text\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # unclosed fence
    assert extract_code("<answer>\ndef f():\n    return 1\n</answer>") == "def f():\n    return 1"
    assert extract_code("    return x + 1\n") == "    return x + 1\n"                       # raw continuation
    gt = {"tests": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "inc", "prefix": "def inc(x):"}
    program = build_program("\n    return x + 1", gt)
    assert program.startswith("def inc(x):\n\n    return x + 1") and program.rstrip().endswith("check(inc)")
    assert build_program("x", {**gt, "tests": gt["tests"] + "check(inc)\n"}).count("check(inc)") == 1
    with pytest.raises(ValueError, match="entry_point"):
        build_program("x", {**gt, "entry_point": "a; import os"})


@pytest.mark.integration
def test_all_humaneval_canonical_solutions_pass():
    from dare.data import DataConfig, load_examples
    from dare.rewards import score_batch

    examples = load_examples(DataConfig(name="humaneval", split="test"))
    assert len(examples) == 164
    good = score_batch("code", [e["canonical_solution"] for e in examples], examples, workers=2)
    assert [e["id"] for e, r in zip(examples, good) if r.score != 1.0] == []
    wrong = score_batch("code", ["    pass\n"] * len(examples), examples, workers=2)
    assert sum(r.score for r in wrong) == 0.0
