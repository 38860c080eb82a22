"""DCP checkpoints: exact resume, pruning, interrupted saves (also a real SIGKILL),
and one 2-rank gloo launch (per-rank values, FSDP2 resharding, load at another world size, an
asynchronous save beside training's collectives)."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gloo_ranks import run_ranks
from torch.distributed.checkpoint import FileSystemWriter

from moevlm.train.checkpoint import (
    HOLD_ENV,
    MARKER,
    CheckpointError,
    CheckpointManager,
    read_marker,
    rng_state,
    set_rng_state,
)

REPO = Path(__file__).parents[2]


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make(seed=0, dropout=0.1, shard=None):
    """2-layer MLP (`shard` applied before the optimizer exists) + AdamW + warmup LambdaLR."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.Linear(8, 2)
    )
    if shard is not None:
        shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def train(model, opt, sched, steps):
    """Uses every RNG that rng_state covers: torch (data, dropout), numpy, python."""
    for _ in range(steps):
        x = torch.randn(8, 4)
        target = torch.full((8, 2), float(np.random.rand()) + random.random())
        torch.nn.functional.mse_loss(model(x), target).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_is_bitwise_identical(tmp_path):
    seed_all(1)
    ref = make()
    train(*ref, steps=6)

    seed_all(1)
    model, opt, sched = make()
    train(model, opt, sched, steps=3)
    ckpt = CheckpointManager(tmp_path, keep=3)
    ckpt.save(
        3,
        model=model,
        optimizer=opt,
        extra={"scheduler": sched, "note": {"run": "a"}},
        per_rank={"data": {"consumed": 24}, "rng": rng_state()},
    )

    seed_all(99)  # a restarted process: other RNG states, other initial weights
    model2, opt2, sched2 = make(seed=5)
    got = ckpt.load(
        ckpt.latest(),
        model=model2,
        optimizer=opt2,
        extra={"scheduler": sched2, "note": None},
        per_rank={"data": None, "rng": None},
    )
    assert got["step"] == 3 and got["world_size"] == 1
    assert got["extra"] == {"scheduler": sched2, "note": {"run": "a"}}
    assert got["per_rank"]["data"] == {"consumed": 24}
    assert_same(params(model2), params(model))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key]), key
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sched2.state_dict() == sched.state_dict()

    set_rng_state(got["per_rank"]["rng"])
    train(model2, opt2, sched2, steps=3)
    assert_same(params(model2), params(ref[0]))


def test_keep_prunes_and_latest_is_newest(tmp_path):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path / "ck", keep=2)
    assert ckpt.latest() is None
    for step in (10, 20, 30, 40):
        ckpt.save(step, model=model, optimizer=opt)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000030", "step_00000040"]
    assert ckpt.latest() == ckpt.step_dir(40)
    marker = read_marker(ckpt.latest())
    assert marker["step"] == 40 and marker["world_size"] == 1 and marker["format"] == 2

    keep_all = CheckpointManager(tmp_path / "all", keep=0)
    for step in (1, 2, 3):
        keep_all.save(step, model=model)
    assert [p.name for p in keep_all.complete()] == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]


def test_failed_save_is_ignored_and_cleaned(tmp_path, monkeypatch):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path, keep=5)
    ckpt.save(1, model=model, optimizer=opt)

    def fail(self, metadata, results):  # data files written, DCP's .metadata not
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "finish", fail)
        with pytest.raises(
            CheckpointError,
            match=r"writing checkpoint step_00000002 in .* failed: OSError: disk "
            r"full; the partial directory was removed and step_00000001 is intact",
        ):
            ckpt.save(2, model=model, optimizer=opt)
    partial = ckpt.step_dir(2)
    assert not partial.exists() and ckpt.latest() == ckpt.step_dir(1)
    partial.mkdir()  # as a killed save leaves it
    (partial / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.load(partial, model=model)

    (partial / "stray").write_text("x")  # saving the same step again starts from an empty dir
    ckpt.save(2, model=model, optimizer=opt)
    assert not (partial / "stray").exists() and ckpt.latest() == partial

    # an incomplete dir newer than the newest complete one is left alone...
    ckpt.step_dir(9).mkdir()
    ckpt.save(3, model=model)
    assert ckpt.step_dir(9).exists() and ckpt.latest() == ckpt.step_dir(3)
    ckpt.save(10, model=model)  # ...until a newer complete checkpoint exists
    assert not ckpt.step_dir(9).exists()
    assert [p.name[-2:] for p in ckpt.complete()] == ["01", "02", "03", "10"]


def test_async_save_is_complete_only_once_written_one_at_a_time(tmp_path, monkeypatch):
    """async_save: `save` returns while DCP writes in the background (held mid-write by the test-only
    hook); the marker, checksums and pruning come after the write; the next save waits for it; what
    is written is the state at `save` (a host copy); a failed write is the sync path's error, raised
    at the next save."""
    model, opt, sched = make()
    train(model, opt, sched, steps=1)
    ckpt = CheckpointManager(tmp_path / "ck", keep=2, async_save=True)
    ckpt.save(1, model=model, optimizer=opt)
    train(model, opt, sched, steps=1)
    want = params(model)
    monkeypatch.setenv(HOLD_ENV, str(tmp_path))
    hold, held = tmp_path / "hold.step_00000002", tmp_path / "held.step_00000002"
    hold.touch()
    path = ckpt.save(2, model=model, optimizer=opt, per_rank={"data": 2})
    while not held.exists():
        time.sleep(0.01)
    # data written, DCP's index and our marker not: never resumed from
    assert [p.name for p in path.iterdir()] == ["__0_0.distcp"] and ckpt.pending == path
    assert ckpt.latest() == ckpt.step_dir(1) == CheckpointManager(tmp_path / "ck").newest_verified()
    train(model, opt, sched, steps=1)  # training goes on meanwhile
    threading.Timer(0.2, hold.unlink).start()
    ckpt.save(3, model=model, optimizer=opt)  # waits for step 2 first
    assert (path / MARKER).exists() and ckpt.pending == ckpt.step_dir(3)
    assert ckpt.wait() == ckpt.step_dir(3) and ckpt.pending is None and ckpt.wait() is None
    assert [p.name for p in ckpt.complete()] == ["step_00000002", "step_00000003"]
    fresh, _, _ = make(seed=7)
    got = CheckpointManager(tmp_path / "ck").load(path, model=fresh, per_rank=["data"])
    assert got["per_rank"]["data"] == 2
    assert_same(params(fresh), want)

    def fail(self, metadata, results):  # data files written, DCP's .metadata not
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "finish", fail)
        ckpt.save(4, model=model, optimizer=opt)  # started: the failure comes later
        with pytest.raises(
            CheckpointError,
            match=r"writing checkpoint step_00000004 in .* failed: OSError: disk "
            r"full; the partial directory was removed and step_00000003 is intact",
        ):
            ckpt.save(5, model=model, optimizer=opt)
    assert not ckpt.step_dir(4).exists() and not ckpt.step_dir(5).exists()
    ckpt.save(5, model=model, optimizer=opt)
    ckpt.close()
    assert [p.name for p in ckpt.complete()] == ["step_00000003", "step_00000005"]


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    from moevlm.train.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ckpt = CheckpointManager(sys.argv[1], keep=3)
    ckpt.save(1, model=model, per_rank={"data": 1})

    real, calls = fs._write_item, []
    def write_then_die(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # part of the file is written
            for a in args:
                getattr(a, "flush", lambda: None)()
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    fs._write_item = write_then_die
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.save(2, model=model, per_rank={"data": 2})
""")


@pytest.mark.slow
def test_killed_save_falls_back_to_previous(tmp_path):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    partial = tmp_path / "step_00000002"
    assert [f.stat().st_size > 0 for f in partial.glob("*.distcp")] == [True] and not (
        partial / MARKER
    ).exists()

    ckpt = CheckpointManager(tmp_path)
    assert ckpt.latest() == tmp_path / "step_00000001"
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    got = ckpt.load(ckpt.latest(), model=model, per_rank=["data"])
    assert got["step"] == 1 and got["per_rank"]["data"] == 1
    assert_same(params(model), params(expected))


def test_mismatched_model_names_keys_and_shapes(tmp_path):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(1, model=model, per_rank={"data": 0})
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Identity(), torch.nn.Linear(3, 2)
    )
    with pytest.raises(
        CheckpointError,
        match=r"2 missing \['1.bias', '1.weight'\], 0 unexpected \[\], 1 with another "
        r"shape \['3.weight: saved \(2, 8\), model \(2, 3\)'\]",
    ):
        ckpt.load(path, model=other)
    with pytest.raises(
        CheckpointError, match=r"0 missing \[\], 2 unexpected \['3.bias', '3.weight'\]"
    ):
        ckpt.load(path, model=torch.nn.Sequential(torch.nn.Linear(4, 8)))
    with pytest.raises(CheckpointError, match="no optimizer state"):
        ckpt.load(path, model=model, optimizer=opt)
    with pytest.raises(
        CheckpointError, match=r"no per_rank.rank0 value\(s\) \['rng'\]; it has \['data'\]"
    ):
        ckpt.load(path, model=model, per_rank=["rng"])
    no_sched = torch.optim.AdamW(model.parameters())  # saved without a scheduler, loaded with one
    path = ckpt.save(2, model=model, optimizer=no_sched)
    with pytest.raises(
        CheckpointError,
        match=r"4 missing \['param_groups.0.bias.initial_lr', .*\]; initial_lr is added",
    ):
        ckpt.load(path, model=model, optimizer=opt)


def test_rng_state_roundtrip():
    state = rng_state()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


# ------------------------------------------------------- 2 ranks, one launch


def _two_rank_checks(rank, root):
    root = Path(root)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    seed_all(0)  # replicated model, same data on both ranks
    model, opt, sched = make(dropout=0.0)
    train(model, opt, sched, steps=2)
    ckpt = CheckpointManager(root, keep=2)
    data = [{"rank": r, "pos": 10 * r} for r in range(2)]
    path = ckpt.save(
        7,
        model=model,
        optimizer=opt,
        extra={"scheduler": sched},
        per_rank={"data": data[rank], "rng": rng_state()},
    )
    assert read_marker(path)["world_size"] == 2 and ckpt.latest() == path

    fresh, opt2, sched2 = make(seed=100 + rank, dropout=0.0)
    got = ckpt.load(
        path, model=fresh, optimizer=opt2, extra={"scheduler": sched2}, per_rank=["data", "rng"]
    )
    assert got["per_rank"]["data"] == data[rank] and got["step"] == 7
    assert_same(params(fresh), params(model))
    assert sched2.state_dict() == sched.state_dict()
    assert ckpt.load_all_ranks(path, "data") == data

    # The same checkpoint into an FSDP2-sharded model: DCP reshards.
    mesh = init_device_mesh("cpu", (2,))
    sharded, opt_s, sched_s = make(seed=200, dropout=0.0, shard=lambda m: fully_shard(m, mesh=mesh))
    ckpt.load(path, model=sharded, optimizer=opt_s, extra={"scheduler": sched_s})
    for (name, p), ps in zip(model.named_parameters(), sharded.parameters()):
        assert torch.equal(ps.full_tensor(), p.detach()), name
        assert torch.equal(opt_s.state[ps]["exp_avg"].full_tensor(), opt.state[p]["exp_avg"]), name
    ckpt.save(8, model=sharded, optimizer=opt_s, per_rank={"data": data[rank]})
    if rank == 0:
        torch.save(params(model), root / "expected.pt")

    # Async (train.async_checkpoint): the FSDP2 state written by a background thread over a gloo
    # group of its own while this thread runs collectives on the default group; the weights changed
    # after `save` returned are not what is written (the state was copied to host memory first).
    ckpt_async = CheckpointManager(root / "async", keep=1, async_save=True)
    ckpt_async.save(9, model=sharded, optimizer=opt_s, per_rank={"data": data[rank]})
    total = torch.ones(1)
    for _ in range(20):
        torch.distributed.all_reduce(total)
    with torch.no_grad():
        for ps in sharded.parameters():
            ps.add_(1.0)
    assert ckpt_async.wait() == ckpt_async.step_dir(9) and total.item() == 2.0**20
    assert read_marker(ckpt_async.step_dir(9))["world_size"] == 2
    ckpt_async.close()


@pytest.mark.slow
def test_two_ranks_gloo(tmp_path):
    root = tmp_path / "ck"
    run_ranks(_two_rank_checks, 2, tmp_path, str(root))

    # Back in one process (world size 1) from a 2-rank FSDP2 save.
    ckpt = CheckpointManager(root)
    assert [p.name for p in ckpt.complete()] == ["step_00000007", "step_00000008"]
    assert json.loads((ckpt.latest() / MARKER).read_text())["world_size"] == 2
    model, opt, _ = make(seed=3)
    got = ckpt.load(ckpt.latest(), model=model, optimizer=opt, per_rank=["data"])
    assert got["per_rank"]["data"] == {"rank": 0, "pos": 0} and got["world_size"] == 2
    assert_same(params(model), torch.load(root / "expected.pt"))
    assert ckpt.load_all_ranks(ckpt.latest(), "data") == [
        {"rank": 0, "pos": 0},
        {"rank": 1, "pos": 10},
    ]
    ckpt = CheckpointManager(root / "async")
    model, opt, _ = make(seed=4)
    assert ckpt.verify(ckpt.latest()) == []
    got = ckpt.load(ckpt.latest(), model=model, optimizer=opt, per_rank=["data"])
    assert got["step"] == 9 and got["per_rank"]["data"] == {"rank": 0, "pos": 0}
    assert_same(params(model), torch.load(root / "expected.pt"))


def test_older_format_is_refused_with_the_reason(tmp_path):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(1, model=model, optimizer=opt)
    marker = path / "COMPLETE.json"
    marker.write_text(marker.read_text().replace('"format": 2', '"format": 1'))
    with pytest.raises(
        ValueError, match="written in checkpoint format 1; this version reads format 2"
    ):
        ckpt.load(path, model=model, optimizer=opt)
