import pytest
import torch

from moevlm.data.sample_cache import ensure_sample


@pytest.fixture(scope="session")
def sample_shards():
    """The embedded sample set (real packaged photos + shipped prose), built once per session (the session's
    cache, tests/conftest.py); read only: a test that damages shards copies them first."""
    return ensure_sample()[0]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One torch thread per test module: the tiny model gains nothing from a second, and on a 2-core
    machine, beside the loader's workers (and other work), two threads fight (tests/train/conftest.py);
    restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
