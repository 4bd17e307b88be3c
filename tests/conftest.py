import os
from pathlib import Path

import pytest
import torch

from tests.threads import TEST_THREADS

ASSETS = Path(__file__).parent / "assets"
FIXTURES = ASSETS / "fixtures"
TOKENIZERS = ASSETS / "tokenizers"
# Every fixture folder and the family it must be detected as.
FIXTURE_FAMILIES = {
    "llada-tiny": "llada", "lladamoe-tiny": "llada_moe", "dream-tiny": "dream", "sdar-tiny": "sdar",
    "sdarmoe-tiny": "sdar_moe", "llada2-tiny": "llada2_moe", "llada21-tiny": "llada2_moe", "rnd1-tiny": "rnd1",
    "fastdllmv2-tiny": "fast_dllm_v2", "nemotron-tiny": "nemotron_diffusion",
}

# Tiny models are overhead-bound: one intra-op thread is as fast on an idle machine and ~10x faster on a busy one.
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Multi-process tests (torchrun, several nodes) run one at a time, on one pytest-xdist worker (``--dist
    loadgroup``): their processes and ports never meet another launch's."""
    for item in items:
        if item.get_closest_marker("multiprocess"):
            if not item.get_closest_marker("integration"):
                raise pytest.UsageError(f"{item.nodeid}: a multiprocess test belongs to the integration tier "
                                        "(mark it @pytest.mark.integration too)")
            item.add_marker(pytest.mark.xdist_group("multiprocess"))


def pytest_collection_finish(session):
    """On a pytest-xdist worker with ``--dist loadgroup``, the group must have reached the test ids (xdist appends
    "@group" to them): a pytest that ignores the rewrite would silently run multi-process tests side by side."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("multiprocess") and not item.nodeid.endswith("@multiprocess")]
    if lost:
        raise pytest.UsageError(f"pytest-xdist's --dist loadgroup did not group {lost[0]} (and {len(lost) - 1} more): "
                                "this pytest/pytest-xdist pair ignores xdist groups (pyproject.toml pins pytest < 9.2)")


@pytest.fixture(scope="session")
def two_process_runs(request, tmp_path_factory):
    """``two_process_runs(case)`` -> (one process, two processes) results of a registered case
    (tests/trainer/two_processes.py); the selected tests' cases are all trained by one launch per side."""
    from tests.trainer.two_processes import Runs, wanted_cases
    return Runs(wanted_cases(request.session.items), tmp_path_factory.mktemp("two_processes"))
