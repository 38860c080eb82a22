"""Fixtures shared by the layout tests (test_layouts.py, test_context_parallel.py)."""

import pytest


@pytest.fixture(scope="session")
def layout_references(tmp_path_factory):
    """(tmp, shards): test_layouts.py's one-process references in `tmp`, computed once for the
    session: ref.pt (validating), ref_<name>.pt for every ROUTER_OPTIONS entry, init_hf.  Under
    pytest-xdist the first worker to ask computes them in the session's folder and the others (whose
    modules run elsewhere: test_context_parallel.py, test_layouts.py) link to them; each worker's
    `tmp` is its own, for the runs it adds."""
    import os
    import shutil

    from filelock import FileLock
    from test_layouts import one_process_references

    from moevlm.data.sample_cache import ensure_sample

    tmp = tmp_path_factory.mktemp("layouts")
    shards = str(ensure_sample()[0])
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: nothing to share
        one_process_references(shards, tmp, init=True)
        return tmp, shards
    shared = tmp_path_factory.getbasetemp().parent / "layout_references"  # every worker's parent
    with FileLock(f"{shared}.lock"):
        if not (shared / "done").exists():
            shutil.rmtree(shared, ignore_errors=True)  # a worker that failed half-way
            shared.mkdir()
            one_process_references(shards, shared, init=True)
            (shared / "done").touch()
    for name in ("ref*.pt", "init_hf"):
        for path in shared.glob(name):
            (tmp / path.name).symlink_to(path)
    return tmp, shards
