import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One torch thread per test module: the tiny model gains nothing from a second, and on a 2-core
    machine, beside the run's data workers (and other work), two threads fight (a 2-step run took 25 s
    with torch's default threads on a busy machine, 1.5 s with one).  Module-scoped, so that a module's
    reference runs (its module fixtures) and its tests agree bit for bit; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
