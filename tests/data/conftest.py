import pytest

from moevlm.data.sample_cache import ensure_sample


@pytest.fixture(scope="session")
def sample_shards():
    """The embedded sample set (real packaged photos + shipped prose), built once per session (the session's
    cache, tests/conftest.py); read only: a test that damages shards copies them first."""
    return ensure_sample()[0]
