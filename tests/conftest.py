import os

# The Triton kernels (kernels/) run on CPU only under the interpreter; it must be
# set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The sample set's cache (moevlm.data.sample_cache) is one folder per test session, built by the first test that
# needs it and reused by the rest, subprocesses included (they inherit the environment): the user's cache is
# neither read nor written, and CI leaves nothing behind.
_SAMPLE_CACHE = tempfile.mkdtemp(prefix="moevlm-test-cache-")
os.environ["MOEVLM_CACHE"] = _SAMPLE_CACHE


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run bench/gpu_suite.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    shutil.rmtree(_SAMPLE_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fp32_and_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def seed(_fp32_and_seed):
    """A fresh seed for the test (printed, so a failure shows it; MOEVLM_TEST_SEED=<seed> replays it).
    Modules whose inputs are fresh every run apply it to every test: `pytestmark = usefixtures("seed")`."""
    seed = int(os.environ.get("MOEVLM_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed} (MOEVLM_TEST_SEED={seed} replays it)")
    torch.manual_seed(seed)
    return seed
