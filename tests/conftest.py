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
    "sdarmoe-tiny": "sdar_moe", "llada2-tiny": "llada2_moe", "llada21-tiny": "llada2_moe",
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
