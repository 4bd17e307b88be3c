import pytest
import torch

from dare.models import tiny
from dare.models.tokenizer import tiny_tokenizer

from tests.threads import TEST_THREADS


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llada(tiny_tok):
    return tiny("llada", tokenizer=tiny_tok, seed=0).eval()


@pytest.fixture()
def one_thread():
    # The CI box has 2 shared cores; tiny models run fastest (and most predictably) on one thread.
    old = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(old)
