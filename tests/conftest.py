import os
from pathlib import Path

import pytest
import torch

ASSETS = Path(__file__).parent / "assets"
FIXTURES = ASSETS / "fixtures"
TOKENIZERS = ASSETS / "tokenizers"
# Every fixture folder and the family it must be detected as.
FIXTURE_FAMILIES = {
    "llada-tiny": "llada", "lladamoe-tiny": "llada_moe", "dream-tiny": "dream", "sdar-tiny": "sdar",
    "sdarmoe-tiny": "sdar_moe", "llada2-tiny": "llada2_moe", "llada21-tiny": "llada2_moe",
}

# Tiny models are overhead-bound: one intra-op thread is as fast on an idle machine and ~10x faster on a busy one.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
