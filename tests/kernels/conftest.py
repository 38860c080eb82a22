"""Fixtures of the kernel tests."""

import os
import random

import pytest
import torch


@pytest.fixture
def seed(_fp32_and_seed):
    """A fresh seed for the test (printed, so a failure shows it; MOEVLM_TEST_SEED=<seed> replays it).
    Modules whose inputs are fresh every run apply it to every test: `pytestmark = usefixtures("seed")`."""
    seed = int(os.environ.get("MOEVLM_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed} (MOEVLM_TEST_SEED={seed} replays it)")
    torch.manual_seed(seed)
    return seed
