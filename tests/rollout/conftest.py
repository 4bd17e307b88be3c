import pytest
import torch

from tests.threads import TEST_THREADS


@pytest.fixture(autouse=True, scope="package")
def _single_thread():
    # The rollout tests run tiny models (hidden 64): one intra-op thread is faster than two, and much faster
    # when other processes share the cores (OpenMP threads spin on the busy CPU).
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)
