import os

# Triton kernels (kernels issue) run on CPU only under the interpreter; it must be
# set before any @triton.jit runs.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fp32_and_seed():
    torch.manual_seed(0)
    yield
