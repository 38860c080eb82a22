import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The tiny model gains nothing from a second torch thread, and on a 2-core machine, beside the run's
    data workers (and other work), two threads fight: a 2-step run took 25 s with torch's default
    threads on a busy machine, 1.5 s with one.  Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
