"""Fixtures shared by the layout tests (test_layouts.py, test_context_parallel.py)."""

import pytest


@pytest.fixture(scope="session")
def layout_references(tmp_path_factory):
    """(tmp, shards): test_layouts.py's one-process references in `tmp`, computed once for the
    session: ref.pt (validating), ref_<name>.pt for every ROUTER_OPTIONS entry, init_hf."""
    from test_layouts import one_process_references

    from moevlm.data.sample_cache import ensure_sample

    tmp = tmp_path_factory.mktemp("layouts")
    shards = str(ensure_sample()[0])
    one_process_references(shards, tmp, init=True)
    return tmp, shards
