"""Checkpoints are never lost or silently damaged: checksums verified on load, damaged ones skipped,
one line of history after a restart from an older checkpoint, disk room checked before writing, and
metrics with one value per step after a resume.

Manager-level cases use a small MLP (fast); trainer-level cases run the embedded default's tiny model
in-process and compare per-step losses with an uninterrupted run.
"""

from __future__ import annotations

import errno
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from moevlm.config import compose_job
from moevlm.data.sample_cache import sample_dir
from moevlm.train import integrity
from moevlm.train.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointManager,
    read_marker,
    retention,
)
from moevlm.train.exit_codes import ExitCode
from moevlm.train.trainer import Trainer
from tests.train.test_checkpoint import assert_same, make, params, train
from tests.train.test_trainer import FAST, read_metrics

# ------------------------------------------------------------------ damage


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def remove_metadata(path: Path) -> None:
    (path.parent / ".metadata").unlink()


DAMAGE = {
    "flipped": (flip_byte, "bytes changed"),
    "truncated": (truncate, "truncated"),
    "no_metadata": (remove_metadata, ".metadata: missing"),
}


def data_file(ckpt_dir: Path) -> Path:
    return sorted(ckpt_dir.glob("*.distcp"))[0]


# ------------------------------------------------------------ file checks


def test_checksums_find_every_kind_of_damage(tmp_path):
    for name, size in (("a.bin", 3 << 20), ("b.bin", 10), ("c.bin", 0)):
        (tmp_path / name).write_bytes(
            torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
        )
    sums = integrity.checksum_files(tmp_path, ["a.bin", "b.bin", "c.bin"])
    assert integrity.file_problems(tmp_path, sums) == []
    flip_byte(tmp_path / "a.bin", at=0.9)  # a flipped bit late in a file read in chunks
    truncate(tmp_path / "b.bin")
    (tmp_path / "c.bin").unlink()
    problems = integrity.file_problems(tmp_path, sums)
    assert len(problems) == 3
    assert "a.bin: checksum" in problems[0] and "bytes changed" in problems[0]
    assert problems[1] == "b.bin: 5 bytes, 10 when saved (truncated)"
    assert problems[2].startswith("c.bin: missing")


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_is_skipped_and_an_explicit_one_refused(tmp_path, kind):
    damage, words = DAMAGE[kind]
    model, opt, sched = make()
    ckpt = CheckpointManager(tmp_path, keep=0)
    good = None
    for step in (1, 2):
        train(model, opt, sched, 1)
        ckpt.save(step, model=model, optimizer=opt)
        good = params(model) if step == 1 else good
    files = read_marker(ckpt.step_dir(2))["files"]
    assert set(files) == {".metadata", *[p.name for p in ckpt.step_dir(2).glob("*.distcp")]}
    damage(data_file(ckpt.step_dir(2)))

    fresh = CheckpointManager(tmp_path, keep=0)  # a relaunch: nothing verified yet
    with pytest.raises(
        CheckpointError, match=f"step_00000002 failed verification .*{words}.*resume=auto"
    ):
        fresh.load(fresh.step_dir(2), model=model, optimizer=opt)
    assert fresh.newest_verified() == fresh.step_dir(1)
    moved, problems = fresh.rejected[0]
    assert (
        moved == tmp_path / "rejected" / "step_00000002" and moved.is_dir() and words in problems[0]
    )
    assert "failed verification" in (tmp_path / "rejected" / "README.txt").read_text()
    assert fresh.latest() == fresh.step_dir(1)  # never picked again
    model2, opt2, _ = make(seed=1)
    fresh.load(fresh.step_dir(1), model=model2, optimizer=opt2)
    assert_same(params(model2), good)


def test_checkpoints_without_checksums_still_load(tmp_path):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(1, model=model, optimizer=opt)
    marker = read_marker(path)
    del marker["files"], marker["checksum"]
    (path / MARKER).write_text(json.dumps(marker))
    assert CheckpointManager(tmp_path).newest_verified() == path


# ------------------------------------------------------------------ disk room


class SmallDisk:
    """A file system of `capacity` bytes holding `root` and `other` bytes of something else."""

    def __init__(self, root: Path, capacity: int, other: int = 0):
        self.root, self.capacity, self.other = root, capacity, other

    def __call__(self, path) -> int:
        return max(0, self.capacity - self.other - integrity.dir_bytes(self.root))


def test_disk_room_prunes_first_or_stops_with_the_numbers(tmp_path, monkeypatch):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path, keep=0)  # keep all: only the disk makes it prune
    size = integrity.dir_bytes(ckpt.save(1, model=model, optimizer=opt))
    disk = SmallDisk(tmp_path, capacity=int(3.5 * size))
    monkeypatch.setattr(integrity, "free_bytes", disk)
    for step in (2, 3):
        ckpt.save(step, model=model, optimizer=opt)
    assert [p.name[-1] for p in ckpt.complete()] == ["1", "2", "3"]
    ckpt.save(4, model=model, optimizer=opt)  # no room for a fourth: the oldest goes first
    assert [p.name[-1] for p in ckpt.complete()] == ["2", "3", "4"]

    # a run whose only checkpoint must stay, an interrupted save's leftovers, a disk filled by others
    root = tmp_path / "other_run"
    ckpt = CheckpointManager(root, keep=0)
    disk.root, disk.capacity = root, 10 * size
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.step_dir(7).mkdir()
    (ckpt.step_dir(7) / "__0_0.distcp").write_bytes(bytes(1000))
    disk.other = 10 * size - integrity.dir_bytes(root) - size // 2
    with pytest.raises(CheckpointError) as err:
        ckpt.save(2, model=model, optimizer=opt)
    msg = str(err.value)
    assert f"not enough disk space for checkpoint step_00000002 in {root}: it needs about" in msg
    assert (
        "are free and pruning older checkpoints would free only" in msg
        and "step_00000001 is intact" in msg
    )
    # nothing was deleted for nothing
    assert ckpt.step_dir(7).exists() and not ckpt.step_dir(2).exists()
    assert CheckpointManager(root).newest_verified() == ckpt.step_dir(1)


def test_a_write_that_runs_out_of_space_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path)
    ckpt.save(1, model=model, optimizer=opt)
    import torch.distributed.checkpoint.filesystem as fs

    real = fs._write_item

    def full(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(
        CheckpointError, match="step_00000002 .* failed: the disk is full .*step_00000001 is intact"
    ):
        ckpt.save(2, model=model, optimizer=opt)
    assert not ckpt.step_dir(2).exists() and CheckpointManager(
        tmp_path
    ).newest_verified() == ckpt.step_dir(1)


def test_pruning_keeps_the_resumed_checkpoint_until_a_newer_one_is_complete(tmp_path):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path, keep=1)
    ckpt.save(1, model=model)
    ckpt.resumed_from = ckpt.step_dir(1)
    ckpt.step_dir(2).mkdir()  # an interrupted save of step 2 (no marker) does not count as newer
    retention.prune(ckpt.root, ckpt.keep, ckpt.resumed_from)
    assert ckpt.complete() == [ckpt.step_dir(1)]
    ckpt.save(2, model=model)
    assert ckpt.complete() == [ckpt.step_dir(2)]


# ------------------------------------------------------------ the trainer


def run(run_dir: Path, steps: int, *more: str) -> tuple[Trainer, int]:
    job = compose_job(
        FAST
        + [
            f"train.steps={steps}",
            f"train.run_dir={run_dir}",
            "train.require_loss_decrease=false",
            *more,
        ]
    )
    trainer = Trainer(job)
    return trainer, trainer.run()


def losses(run_dir: Path) -> dict[int, float]:
    recs = read_metrics(run_dir)
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: float(r["loss"]) for r in recs}


def tensorboard_steps(run_dir: Path, tag: str = "train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """4 steps, a checkpoint after each."""
    run_dir = tmp_path_factory.mktemp("ref")
    _, code = run(run_dir, 4, "train.checkpoint_every=1", "train.keep_checkpoints=0")
    assert code == 0
    return run_dir, losses(run_dir)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_trainer_resumes_from_the_previous_verified_checkpoint(reference, tmp_path, kind, capsys):
    ref_dir, want = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    newest = run_dir / "checkpoints" / "step_00000004"
    DAMAGE[kind][0](data_file(newest))
    records = read_metrics(run_dir)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records + records[-1:])
    )

    trainer, code = run(
        run_dir, 4, "train.checkpoint_every=1", "train.keep_checkpoints=0", "train.resume=auto"
    )
    out = capsys.readouterr().out
    assert code == 0 and trainer.ckpt.resumed_from == run_dir / "checkpoints" / "step_00000003"
    assert "step_00000004 failed verification" in out and DAMAGE[kind][1] in out
    assert (run_dir / "checkpoints" / "rejected" / "step_00000004").is_dir()
    # step 4 logged once (the crashed run's record dropped), recomputed exactly
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4] and abs(got[4] - want[4]) <= 1e-6


@pytest.mark.slow
def test_restart_from_an_older_checkpoint_keeps_one_line_of_history(reference, tmp_path, capsys):
    """Resume from step 2 while steps 3 and 4 exist, be killed after saving step 3, relaunch with auto:
    the new line's checkpoints survive pruning, the old line's are moved aside (not picked, not lost),
    metrics and TensorBoard hold one value per step."""
    ref_dir, want = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir, run_dir)
    ck = run_dir / "checkpoints"
    old = {p.name: read_marker(p)["time"] for p in ck.glob("step_*")}

    class Killed(Exception):
        pass

    job = compose_job(
        FAST
        + [
            "train.steps=4",
            f"train.run_dir={run_dir}",
            "train.checkpoint_every=1",
            "train.keep_checkpoints=1",
            f"train.resume={ck / 'step_00000002'}",
        ]
    )
    trainer = Trainer(job)
    out = capsys.readouterr().out
    assert "moved to" in out and "step_00000003, step_00000004" in out
    abandoned = [p for p in ck.iterdir() if p.name.startswith("abandoned-")]
    assert len(abandoned) == 1 and sorted(p.name for p in abandoned[0].glob("step_*")) == [
        "step_00000003",
        "step_00000004",
    ]
    # the old line's records, kept with its checkpoints
    assert (abandoned[0] / "metrics.jsonl").exists()

    def kill_in_step_4(tr):  # (called before the step count moves on)
        if tr.step == 3:
            raise Killed

    trainer.grad_hook = kill_in_step_4
    with pytest.raises(Killed):
        trainer.run()
    # keep=1: step 2 pruned after 3 was done
    assert [p.name for p in trainer.ckpt.complete()] == ["step_00000003"]
    assert read_marker(ck / "step_00000003")["time"] > old["step_00000003"]  # the new line's

    capsys.readouterr()
    trainer, code = run(
        run_dir, 4, "train.checkpoint_every=1", "train.keep_checkpoints=1", "train.resume=auto"
    )
    assert code == 0 and f"resumed from {ck / 'step_00000003'} at step 3" in capsys.readouterr().out
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - want[s]) for s in got) <= 1e-6
    assert tensorboard_steps(run_dir) == [1, 2, 3, 4]
    assert sorted(p.name for p in abandoned[0].glob("step_*")) == ["step_00000003", "step_00000004"]


@pytest.mark.slow
def test_no_room_for_a_checkpoint_stops_cleanly_and_the_run_continues_later(
    reference, tmp_path, monkeypatch, capsys
):
    ref_dir, want = reference
    size = integrity.dir_bytes(ref_dir / "checkpoints" / "step_00000002")
    run_dir = tmp_path / "run"
    disk = SmallDisk(run_dir / "checkpoints", capacity=int(1.6 * size))
    monkeypatch.setattr(integrity, "free_bytes", disk)
    trainer, code = run(run_dir, 4, "train.checkpoint_every=2", "train.keep_checkpoints=2")
    out = capsys.readouterr().out
    assert code == ExitCode.CHECKPOINT and trainer.step == 4
    assert f"not enough disk space for checkpoint step_00000004 in {run_dir / 'checkpoints'}" in out
    assert [p.name for p in trainer.ckpt.complete()] == ["step_00000002"]

    disk.capacity *= 4  # room was made: the relaunch resumes from the intact checkpoint
    trainer, code = run(run_dir, 4, "train.checkpoint_every=2", "train.keep_checkpoints=2")
    assert code == 0 and trainer.ckpt.resumed_from == run_dir / "checkpoints" / "step_00000002"
    got = losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4] and max(abs(got[s] - want[s]) for s in got) <= 1e-6


def test_a_failed_background_write_stops_the_run_at_the_next_save(tmp_path, monkeypatch, capsys):
    """train.async_checkpoint: step 2's write fails in the background (DCP's writer raises, as a full
    disk would); the save of step 3 raises it: the sync path's line and exit code, step 1 intact."""
    real = FileSystemWriter.finish

    def fail_step_2(self, *args, **kwargs):  # data files written, DCP's .metadata not
        if Path(self.path).name == "step_00000002":
            raise OSError("disk full")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "finish", fail_step_2)
    run_dir = tmp_path / "run"
    trainer, code = run(run_dir, 3, "train.checkpoint_every=1", "train.async_checkpoint=true")
    out = capsys.readouterr().out
    assert code == ExitCode.CHECKPOINT and trainer.step == 3, out
    assert (
        f"stopping at step 3: writing checkpoint step_00000002 in {run_dir / 'checkpoints'} failed: "
        "OSError: disk full; the partial directory was removed and step_00000001 is intact"
    ) in out
    assert [p.name for p in trainer.ckpt.complete()] == ["step_00000001"]
    assert not trainer.ckpt.step_dir(2).exists() and not trainer.ckpt.step_dir(3).exists()


@pytest.mark.slow
def test_data_problems_on_resume_or_in_training_end_in_one_line(reference, tmp_path, capsys):
    """Shards rewritten under the same names since the checkpoint: a CheckpointError naming them and the
    option that continues (DataResumeRefused, train.py: exit 8), nothing trained; data where no sample fits the budgets: exit 8 with the skip counts, no hang."""
    ref_dir, _ = reference
    run_dir, shards = tmp_path / "run", tmp_path / "shards"
    shutil.copytree(ref_dir, run_dir)
    shutil.copytree(sample_dir(), shards)  # a copy to damage: the cached set is shared by every run
    shard, other = sorted(shards.glob("*.tar"))[:2]
    shard.write_bytes(other.read_bytes())
    job = compose_job(FAST + ["train.steps=5", f"train.run_dir={run_dir}", f"data.shards={shards}"])
    with pytest.raises(
        CheckpointError,
        match=f"cannot resume the data from .*step_00000004: .*{shard.name}.*"
        "allow_changed_shards=true",
    ) as refused:
        Trainer(job)
    assert refused.value.exit_code == ExitCode.DATA
    # the user's choice
    trainer, code = run(run_dir, 5, f"data.shards={shards}", "data.allow_changed_shards=true")
    assert code == 0 and trainer.step == 5

    trainer, code = run(
        tmp_path / "tiny_budget", 2, "data.pack.seq_len=8", "data.pack.oversize=skip"
    )
    err = capsys.readouterr().err
    assert code == 8 and trainer.step == 0
    assert (
        "stopping at step 0: data stream" in err and "could pack none" in err and "too_long=" in err
    )


# ------------------------------------------------------ crafted and malformed


class Payload:
    """Unpickled, it creates `flag` (through a builtin callable: no moevlm or test code needed)."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return (open, (str(self.flag), "w"))


def craft(path: Path, change) -> None:
    """Rewrite checkpoint `path` with `change(state)` applied to all its items (nested as saved),
    then recompute the marker's checksums as a forger would."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(  # what format_utils.dcp_to_torch_save does: every item, as saved
        state,
        storage_reader=FileSystemReader(path),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    change(state)
    for f in integrity.stored_files(path, skip=[MARKER]):
        (path / f).unlink()
    dcp_save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    rechecksum(path)


def rechecksum(path: Path) -> None:
    marker = json.loads((path / MARKER).read_text())
    marker["files"] = integrity.checksum_files(path, integrity.stored_files(path, skip=[MARKER]))
    (path / MARKER).write_text(json.dumps(marker))


def pickled_extra(flag):
    def change(state):
        for k in [k for k in state["extra"] if k.startswith("scheduler")]:
            del state["extra"][k]
        state["extra"]["scheduler"] = Payload(flag)  # a DCP byte item (torch.save of the object)

    return change


def pickle_for_json(flag):
    def change(state):
        blob = bytearray(pickle.dumps(Payload(flag)))
        state["per_rank"]["rank0"]["rng"] = torch.frombuffer(blob, dtype=torch.uint8)

    return change


def pickled_optimizer_item(flag):
    def change(state):
        state["optim"][next(k for k in state["optim"] if k.endswith(".lr"))] = Payload(flag)

    return change


CRAFTED = {
    "extra_as_pickle": (pickled_extra, "extra.scheduler is not stored as JSON but as a pickled"),
    "pickle_in_json": (pickle_for_json, "per_rank.rank0.rng is not a value this version reads"),
    "optimizer_item": (pickled_optimizer_item, r"optim\.param_groups\..*\.lr is not plain data"),
    "metadata": (None, r"\.metadata is not a DCP index this version reads"),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_a_crafted_checkpoint_runs_nothing_and_is_refused(reference, tmp_path, kind):
    """A real checkpoint of the tiny model with one item replaced by a pickle whose unpickling would
    create a file, its checksums recomputed: train.resume=PATH refuses it naming the item."""
    make_change, words = CRAFTED[kind]
    ref_dir, _ = reference
    src = tmp_path / "ref"
    shutil.copytree(ref_dir / "checkpoints" / "step_00000004", src / "step_00000004")
    path, flag = src / "step_00000004", tmp_path / "PWNED"
    if make_change is None:
        (path / ".metadata").write_bytes(pickle.dumps(Payload(flag)))
        rechecksum(path)
    else:
        craft(path, make_change(flag))
    problems = CheckpointManager(src).verify(path)  # the checksums agree; the index is read safely
    assert not flag.exists() and problems == ([] if make_change else [problems[0]])
    assert make_change or ".metadata is not a DCP index this version reads" in problems[0]
    job = compose_job(
        FAST + ["train.steps=5", f"train.run_dir={tmp_path / 'run'}", f"train.resume={path}"]
    )
    with pytest.raises(CheckpointError, match=words) as err:
        Trainer(job)
    assert not flag.exists(), "the payload ran"
    assert "\n" not in str(err.value)


def test_values_round_trip_as_json_and_tensors(tmp_path):
    model, opt, _ = make()
    values = {
        "t": (1, 2.5, None, True, "s", float("inf")),
        "ints": {3: "three", (1, 2): [torch.arange(3)]},
        "tag": {"__tuple__": 1},
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "np": np.float64(0.5),
    }
    ckpt = CheckpointManager(tmp_path)
    path = ckpt.save(1, model=model, optimizer=opt, extra={"v": values})
    got = CheckpointManager(tmp_path).load(path, model=model, optimizer=opt, extra={"v": None})
    v = got["extra"]["v"]
    assert v["t"] == values["t"] and v["tag"] == values["tag"] and v["np"] == 0.5
    assert v["ints"][3] == "three" and torch.equal(v["ints"][(1, 2)][0], torch.arange(3))
    assert v["arr"].dtype == np.uint32 and (v["arr"] == values["arr"]).all()
    with pytest.raises(TypeError, match="extra.bad holds a Payload"):
        ckpt.save(2, model=model, extra={"bad": Payload(tmp_path / "x")})


def bad_json(m):
    return "{not json"


MALFORMED = {
    "not_json": (bad_json, "is not JSON"),
    "a_list": (lambda m: json.dumps([m]), "holds a JSON list, not an object"),
    "wrong_type": (lambda m: json.dumps({**m, "step": "2"}), "its step is '2', not an integer"),
    "missing_keys": (
        lambda m: json.dumps({k: v for k, v in m.items() if k != "world_size"}),
        "it has no world_size",
    ),
    "empty_files": (lambda m: json.dumps({**m, "files": {}}), "its file list is empty"),
    "old_format": (lambda m: json.dumps({**m, "format": 1}), "written in checkpoint format 1"),
}


def test_malformed_markers_are_set_aside_in_one_line(tmp_path):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path, keep=0)
    kinds = sorted(MALFORMED)
    for step in range(1, len(kinds) + 2):
        ckpt.save(step, model=model, optimizer=opt)
    for step, kind in enumerate(kinds, start=2):
        rewrite, _ = MALFORMED[kind]
        marker = ckpt.step_dir(step) / MARKER
        marker.write_text(rewrite(json.loads(marker.read_text())))
    fresh = CheckpointManager(tmp_path, keep=0)
    for step, kind in enumerate(kinds, start=2):
        words = MALFORMED[kind][1]
        problems = fresh.verify(fresh.step_dir(step))  # never "verified"
        assert len(problems) == 1 and words in problems[0] and "\n" not in problems[0], kind
        with pytest.raises((CheckpointError, ValueError), match=words):
            fresh.load(fresh.step_dir(step), model=model, optimizer=opt)
    assert fresh.newest_verified() == fresh.step_dir(1)
    moved = sorted(p.name for p, _ in fresh.rejected)
    assert moved == [f"step_{s:08d}" for s in range(2, len(kinds) + 2)]
    readme = (tmp_path / "rejected" / "README.txt").read_text().splitlines()
    assert len(readme) == len(kinds) and all(
        any(MALFORMED[k][1] in line for line in readme) for k in kinds
    )
    assert fresh.complete() == [fresh.step_dir(1)]


def test_resume_at_a_directory_that_is_not_a_checkpoint_says_what_to_set(reference, tmp_path):
    ref_dir, _ = reference
    job = compose_job(
        FAST + ["train.steps=5", f"train.run_dir={tmp_path / 'run'}", f"train.resume={ref_dir}"]
    )
    with pytest.raises(CheckpointError, match=f"train.run_dir={ref_dir} train.resume=auto"):
        Trainer(job)
    with pytest.raises(CheckpointError, match="holds checkpoints .* train.resume=.*step_00000004"):
        read_marker(ref_dir / "checkpoints")
    with pytest.raises(CheckpointError, match="does not exist: train.resume takes auto, none"):
        read_marker(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no COMPLETE.json.*train.resume=auto"):
        read_marker(tmp_path / "empty")


def test_disk_room_prunes_abandoned_checkpoints_first_oldest_first(tmp_path, monkeypatch):
    model, opt, _ = make()
    ckpt = CheckpointManager(tmp_path, keep=0)
    size = integrity.dir_bytes(ckpt.save(1, model=model, optimizer=opt))
    for step in (2, 3):
        ckpt.save(step, model=model, optimizer=opt)
    old, older = "abandoned-20210101T000000Z", "abandoned-20200101T000000Z"
    ckpt.set_aside([ckpt.step_dir(3)], old, "a run restarted from step 1")
    ckpt.set_aside([ckpt.step_dir(2)], older, "a run restarted from step 1")
    disk = SmallDisk(tmp_path, capacity=int(4.5 * size))  # 3 checkpoints, 1.5 free
    monkeypatch.setattr(integrity, "free_bytes", disk)
    ckpt.save(2, model=model, optimizer=opt)  # fits: nothing pruned
    assert (tmp_path / older / "step_00000002").is_dir()
    ckpt.save(3, model=model, optimizer=opt)  # the oldest abandoned folder's goes first
    assert not (tmp_path / older / "step_00000002").exists()
    assert (tmp_path / old / "step_00000003").is_dir()
    assert "pruned step_00000002 to make room" in (tmp_path / older / "README.txt").read_text()
    ckpt.save(4, model=model, optimizer=opt)
    assert not (tmp_path / old / "step_00000003").exists()
    assert [p.name[-1] for p in ckpt.complete()] == ["1", "2", "3", "4"]
    ckpt.save(5, model=model, optimizer=opt)  # nothing abandoned left: the oldest complete one
    assert [p.name[-1] for p in ckpt.complete()] == ["2", "3", "4", "5"]


def test_a_crafted_index_under_resume_auto_is_set_aside_and_the_one_before_used(
    reference, tmp_path
):
    ref_dir, _ = reference
    root = tmp_path / "checkpoints"
    shutil.copytree(ref_dir / "checkpoints", root)
    newest, flag = root / "step_00000004", tmp_path / "PWNED"
    (newest / ".metadata").write_bytes(pickle.dumps(Payload(flag)))
    rechecksum(newest)
    ck = CheckpointManager(root)
    assert ck.newest_verified() == root / "step_00000003" and not flag.exists()
    ((moved, problems),) = ck.rejected
    assert (
        moved == root / "rejected" / "step_00000004"
        and ".metadata is not a DCP index" in problems[0]
    )
