"""Fixtures of the CUDA tests."""

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _cuda_memory_freed():
    """Each CUDA test starts with what earlier tests left (a failed test's frames hold its models and
    graph pools) collected and the allocator's cache emptied: memory figures are this test's."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
