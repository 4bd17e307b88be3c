"""What every sandbox battery file shares: the isolation modes that work here (each case runs in each), the short
limits of hostile cases, and the checks that nothing a program started outlives it."""
import fcntl
import os
import tempfile
import time
from pathlib import Path

import pytest

import dare
from dare.rewards import SandboxLimits, available_isolations, detect_isolation, get_reward
from dare.rewards.sandbox_uids import _UID_BASE, _UID_SLOTS

HUMANEVAL = Path(dare.__file__).parent / "assets" / "data" / "human-eval" / "HumanEval.jsonl.gz"
IS_ROOT = os.geteuid() == 0
MODES = available_isolations()
code = get_reward("code")
# Short limits keep each hostile case within a few seconds.
HOSTILE_LIMITS = SandboxLimits(timeout=2.0, memory_bytes=256 << 20, max_processes=12, max_output=64 << 10)


def needs_containment(mode, what):
    """The fallback without its own uid (not root, or DARE_SANDBOX_NO_UID_DROP) cannot stop a program acting as our
    own user (documented)."""
    if mode == "none" and not detect_isolation()[1]:
        pytest.skip(f"fallback sandbox as an ordinary user does not contain {what} (install bubblewrap)")


def _slot_in_use(uid: int) -> bool:
    """Whether a live sandbox holds ``uid``'s slot (dare/rewards/sandbox_uids.py): the other pytest-xdist worker's, or a
    scorer's beside the tests. Its processes are that sandbox's, not a leftover of ours (and its release kills every
    process of the uid, a leftover under it included)."""
    try:
        fd = os.open(os.path.join(tempfile.gettempdir(), "dare-sandbox-uid-locks", str(uid)), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it our lock, if we took it
    return False


def leftovers(*markers: str) -> list[str]:
    """Live processes whose command line holds a marker, or that run as a sandbox uid whose slot no live sandbox
    holds."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            uid = os.stat(f"/proc/{entry}").st_uid
        except (OSError, IndexError):
            continue
        if state == b"Z":
            continue
        sandbox_uid = IS_ROOT and _UID_BASE <= uid < _UID_BASE + _UID_SLOTS
        if sandbox_uid and _slot_in_use(uid):
            continue
        if any(m in cmdline for m in markers) or sandbox_uid:
            found.append(f"{entry} uid={uid} {cmdline[:120]}")
    return found


def assert_nothing_left(*markers: str) -> None:
    deadline = time.monotonic() + 3.0
    while (left := leftovers("dare-sandbox-", *markers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes outlived the sandbox: {left}"


def example(tests: str, prefix: str = "", entry_point=None) -> dict:
    return {"task": "mbpp", "ground_truth": {"tests": tests, "entry_point": entry_point, "prefix": prefix}}


ESCAPED = example("assert escaped() is True")


def assert_sandbox_still_works():
    assert code("def f():\n    return 2\n", example("assert f() == 2")) == 1.0
