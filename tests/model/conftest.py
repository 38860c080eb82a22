import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One torch thread per test module: the tiny model gains nothing from a second, and on a busy 2-core
    machine two threads fight (tests/train/conftest.py); restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
