"""Exports are all or nothing and never overwrite what they did not write (moevlm.parallel.hf_io
export_folder): an earlier export of the run is replaced whole (no stale index or shards survive); the
source checkpoint, a user's folder and another run's export are refused, at set-up and again at export
time, untouched; a failure or a kill at any point of the writer leaves the previous folder or none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moevlm.model import Qwen3VLMoe, VLMConfig, hf
from moevlm.parallel import hf_io
from moevlm.parallel.hf_io import (
    EXPORT_MARKER,
    ExportTargetError,
    check_export_target,
    export_folder,
    export_marker,
    save_hf,
)


def snapshot(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def tiny(seed: int) -> Qwen3VLMoe:
    torch.manual_seed(seed)
    return Qwen3VLMoe(VLMConfig.preset("tiny"))


def export(model, target, run_dir, step=1, shard_bytes=5 << 30):
    return export_folder(
        target,
        lambda out: save_hf(model, out, max_shard_bytes=shard_bytes),
        run_dir=run_dir,
        step=step,
        kind="hf",
    )


def assert_loads_as(folder: Path, model) -> None:
    back = Qwen3VLMoe.from_pretrained(folder)
    want = model.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_an_earlier_sharded_export_is_replaced_whole(tmp_path):
    """The issue's case: a single-file export over an index + shards.  Both moevlm's import and
    transformers' load the new weights; nothing of the old layout is left."""
    run, target = tmp_path / "run", tmp_path / "hf"
    old, new = tiny(1), tiny(2)
    export(old, target, run, step=1, shard_bytes=1 << 18)
    assert (target / "model.safetensors.index.json").exists()
    assert len(list(target.glob("model-*.safetensors"))) > 1
    export(new, target, run, step=2)
    assert sorted(p.name for p in target.iterdir()) == sorted(
        ["config.json", EXPORT_MARKER, "model.safetensors"]
    )
    assert export_marker(target)["step"] == 2 and export_marker(target)["run_dir"] == str(run)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert_loads_as(target, new)
    import transformers

    ref = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(target)
    ids = torch.randint(0, new.config.text.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            ref(input_ids=ids).logits, new(input_ids=ids).logits, atol=1e-4, rtol=1e-4
        )
    # and back: sharded over the single file
    export(old, target, run, step=3, shard_bytes=1 << 18)
    assert not (target / "model.safetensors").exists()
    assert_loads_as(target, old)


def test_the_source_a_user_folder_and_another_runs_export_are_refused(tmp_path):
    run = tmp_path / "run"
    source = tmp_path / "models" / "src"
    tiny(1).save_pretrained(source)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.json").write_text('{"mine": true}\n')
    (user / "notes.txt").write_text("keep\n")
    other = tmp_path / "other_export"
    export(tiny(3), other, tmp_path / "another_run")
    before = {p: snapshot(p) for p in (source, user, other)}
    cases = [
        (source, {"model.hf_checkpoint": source}, "is model.hf_checkpoint"),
        (source.parent, {"model.hf_checkpoint": source}, "holds model.hf_checkpoint"),
        (user, {}, "exists, is not empty and is not a moevlm export (no moevlm_export.json)"),
        (other, {}, f"holds the export of another run ({tmp_path / 'another_run'}, step 1)"),
        (run, {}, "is the run directory"),
    ]
    for target, protected, says in cases:
        with pytest.raises(ExportTargetError, match=r"^train.export_hf=\S+ " + _re(says)) as err:
            check_export_target(target, run, "train.export_hf", protected)
        assert "\n" not in str(err.value)
        called = []  # and at export time: refused before anything is written
        with pytest.raises(ExportTargetError):
            export_folder(
                target,
                called.append,
                run_dir=run,
                step=1,
                kind="hf",
                protected=protected,
            )
        assert called == []
    assert {p: snapshot(p) for p in (source, user, other)} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_export_target(empty, run) == empty  # an empty folder is free
    assert check_export_target(tmp_path / "new", None) == tmp_path / "new"


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_set_up_refuses_before_training(tmp_path):
    """The trainer's set-up checks both export options before it claims a run directory or builds."""
    from moevlm.config import compose_job
    from moevlm.train.trainer import Trainer

    source = tmp_path / "src"
    tiny(1).save_pretrained(source)
    before = snapshot(source)
    run = tmp_path / "run"
    with pytest.raises(ExportTargetError, match="is model.hf_checkpoint"):
        Trainer(
            compose_job(
                [
                    f"model.hf_checkpoint={source}",
                    f"train.export_hf={source}",
                    f"train.run_dir={run}",
                ]
            )
        )
    assert snapshot(source) == before and not run.exists()
    with pytest.raises(ExportTargetError, match="out is train.export_adapter"):
        Trainer(
            compose_job(
                [
                    "model.lora_rank=4",
                    f"train.export_hf={tmp_path / 'out'}",
                    f"train.export_adapter={tmp_path / 'out'}",
                ]
            )
        )


KILL_POINTS = [
    ("first shard", "write_file", 1),
    ("second shard", "write_file", 2),
    ("index and config", "write_index_and_config", 1),
    ("flush before the rename", "_flush", 1),
    ("the swap", "_exchange", 1),
]


@pytest.mark.parametrize("previous", [True, False], ids=["over_an_export", "new_folder"])
def test_a_failure_anywhere_in_the_writer_leaves_the_previous_folder_or_none(
    tmp_path, monkeypatch, previous
):
    run, target = tmp_path / "run", tmp_path / "hf"
    old = tiny(1)
    if previous:
        export(old, target, run, step=1)
    before = snapshot(target) if previous else None
    new = tiny(2)
    for what, name, nth in KILL_POINTS[: None if previous else -1]:  # a new folder: one rename
        owner = hf if name.startswith("write") else hf_io
        real, calls = getattr(owner, name), []

        def dies(*args, _real=real, _calls=calls, _nth=nth, **kw):
            _calls.append(1)
            if len(_calls) == _nth:
                raise OSError(28, "No space left on device (injected)")
            return _real(*args, **kw)

        monkeypatch.setattr(owner, name, dies)
        with pytest.raises(OSError, match="injected"):
            export(new, target, run, step=2, shard_bytes=1 << 18)
        monkeypatch.setattr(owner, name, real)
        if previous:
            assert snapshot(target) == before, what
            assert_loads_as(target, old)
        else:
            assert not target.exists(), what
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], what
    export(new, target, run, step=2)  # and the next export goes through
    assert_loads_as(target, new)


KILLED = """
import sys, time
from pathlib import Path
import torch
from moevlm.model import Qwen3VLMoe, VLMConfig, hf
from moevlm.parallel.hf_io import export_folder, save_hf

real = hf.write_file
def slow(path, *a, **kw):
    real(path, *a, **kw)
    print("wrote", Path(path).name, flush=True)
    time.sleep(60)
hf.write_file = slow
torch.manual_seed(2)
model = Qwen3VLMoe(VLMConfig.preset("tiny"))
export_folder(sys.argv[1], lambda out: save_hf(model, out, max_shard_bytes=1 << 18),
              run_dir=sys.argv[2], step=2, kind="hf")
"""


def test_sigkill_during_an_export_leaves_the_previous_folder(tmp_path):
    run, target = tmp_path / "run", tmp_path / "hf"
    old = tiny(1)
    export(old, target, run, step=1)
    before = snapshot(target)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(target), str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().startswith("wrote model-00001-of-")
    finally:
        proc.kill()
        proc.wait()
    assert snapshot(target) == before  # the partial folder is hidden beside it, unmarked
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert export_marker(partial) is None
    assert_loads_as(target, old)
    export(tiny(2), target, run, step=2)  # the next export removes the killed one's folder
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_refusal_at_the_end_of_a_run_is_one_line_and_exit_7(tmp_path, capsys):
    """The target taken while the run trained: refused at export time with one line, exit 7, the
    folder untouched and the checkpoint intact; a relaunch naming a new folder resumes at the last
    step and exports."""
    from moevlm.config import compose_job
    from moevlm.train.trainer import Trainer

    run, target = tmp_path / "run", tmp_path / "hf"
    common = ["data.num_workers=1", "data.streams=1", "train.steps=1", f"train.run_dir={run}"]
    common += ["train.require_loss_decrease=false"]
    trainer = Trainer(compose_job([*common, f"train.export_hf={target}"]))
    target.mkdir()
    (target / "notes.txt").write_text("mine\n")  # a user's file, made while the run trained
    capsys.readouterr()
    assert trainer.run() == 7
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"stopping at step 1: export refused: train.export_hf={target} exists, is not empty"
    ), err
    assert "nothing was written there; the run's checkpoint " in err[0]
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    fresh = tmp_path / "hf2"
    # a relaunch (it resumes at step 1 and exports) whose export meets a full disk: one line, 7
    real = hf.write_file

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(args[0]))

    hf.write_file = full
    try:
        assert Trainer(compose_job([*common, f"train.export_hf={fresh}"])).run() == 7
    finally:
        hf.write_file = real
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"stopping at step 1: export failed: writing {fresh} failed: the disk is full; nothing "
        "was written there; the run's checkpoint "
    ), err
    assert not fresh.exists() and not list(tmp_path.glob(".hf2*"))
    assert Trainer(compose_job([*common, f"train.export_hf={fresh}"])).run() == 0
    assert export_marker(fresh)["step"] == 1 and (fresh / "model.safetensors").exists()


def _export_on_two_ranks(rank: int, target: str, user: str, run_dir: str) -> None:
    """Each rank writes its own file (as the pipeline stages' first ranks do); rank 0 marks and
    renames; a refusal is raised on both ranks (no rank left waiting in a collective)."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(dims=SimpleNamespace(world=2, pp=2))

    def write(folder: Path) -> None:
        (folder / f"part-{rank}.txt").write_text(str(rank))

    export_folder(target, write, run_dir=run_dir, step=1, kind="hf", ctx=ctx)
    assert sorted(p.name for p in Path(target).iterdir()) == [
        EXPORT_MARKER,
        "part-0.txt",
        "part-1.txt",
    ]
    with pytest.raises(ExportTargetError, match="is not a moevlm export"):
        export_folder(user, write, run_dir=run_dir, step=1, kind="hf", ctx=ctx)


def test_an_export_from_two_ranks_is_renamed_by_rank_0(tmp_path):
    from gloo_ranks import run_ranks

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep\n")
    run_ranks(
        _export_on_two_ranks, 2, tmp_path, str(tmp_path / "hf"), str(user), str(tmp_path / "run")
    )
    assert (user / "notes.txt").read_text() == "keep\n" and len(list(user.iterdir())) == 1
