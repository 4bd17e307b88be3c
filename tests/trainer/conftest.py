import pytest
import torch

from tests.threads import TEST_THREADS


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny models are far too small for intra-op parallelism; on a shared 2-core box extra threads only spin.
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)
