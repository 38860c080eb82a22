import os

# The Triton kernels (kernels/) run on CPU only under the interpreter; it must be
# set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's CPU kernels built scalar, in every process of the session: the tests check graphs (breaks,
# recompiles) and parity with eager at fixed tolerances, not how a fused CPU kernel is written, and g++
# on the vectorized kernels was most of a compile test's time (tests/train/test_compile.py: 676 s ->
# 316 s cold with this and one compile thread).  CUDA kernels are not affected.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: a thread waiting at a barrier sleeps rather than spins (set before torch
    # starts OpenMP); a test that asks for two threads (test_fp8_training) does not steal the other's core
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import compileall  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# The sample set's cache (moevlm.data.sample_cache) is one folder per test session, built by the first test that
# needs it and reused by the rest, subprocesses and pytest-xdist's workers included (they inherit the
# environment): the user's cache is neither read nor written, and CI leaves nothing behind.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SAMPLE_CACHE = os.environ.get("MOEVLM_TEST_SESSION_CACHE") if _WORKER else None
_OWN_CACHE = _SAMPLE_CACHE is None
if _OWN_CACHE:
    _SAMPLE_CACHE = os.environ["MOEVLM_TEST_SESSION_CACHE"] = tempfile.mkdtemp(
        prefix="moevlm-test-cache-"
    )
os.environ["MOEVLM_CACHE"] = _SAMPLE_CACHE
if _OWN_CACHE and sys.dont_write_bytecode:
    # PYTHONDONTWRITEBYTECODE (set in some CI images): the suite starts about 500 Python processes,
    # and each would compile every moevlm module it imports from source (0.5 CPU-s of `import
    # train`'s 3.6, measured); compiled once here, into the __pycache__ folders .gitignore covers
    for _folder in ("moevlm", "tests", "bench"):
        compileall.compile_dir(os.path.join(_REPO, _folder), quiet=1)
    compileall.compile_file(os.path.join(_REPO, "train.py"), quiet=1)
if _WORKER:  # one of `-n 2`'s workers (pyproject's addopts): a core each, its subprocesses too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped, with the reason, where there is none.  (The
    modules run in xdist's order: under --dist loadscope, those with the most tests first, which
    spreads the costly multi-process modules among light ones.)"""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run bench/gpu_suite.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config):
    if _OWN_CACHE:
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
