import pytest

from moevlm.data.build_shards import build_sample


@pytest.fixture(scope="session")
def sample_shards(tmp_path_factory):
    """The embedded sample set (real packaged photos + shipped prose), built once."""
    out = tmp_path_factory.mktemp("sample_shards")
    build_sample(out, progress=False)
    return out
