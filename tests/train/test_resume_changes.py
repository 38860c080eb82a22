"""A resume says what changed (moevlm.train.checkpoint.record): each difference between the
checkpoint's launch and this one is one line `resume: <key>: <old> -> <new>`; another tokenizer (same
size, other ids) or another architecture is refused (exit 7) unless train.resume_allow_changes names
it.  One small checkpoint, resumed (set up, not run) once per class."""

from __future__ import annotations

import json
import re

import pytest
from test_trainer import FAST

from moevlm.config import compose_job
from moevlm.data.sample_cache import sample_dir
from moevlm.train.checkpoint import CheckpointError, CheckpointManager, read_marker
from moevlm.train.trainer import Trainer


marker_record = ("config", "architecture", "tokenizer")


def test_noted_refused_and_allowed_changes(tmp_path, capsys):
    common = FAST + [
        f"train.run_dir={tmp_path / 'run'}",
        "train.tensorboard=false",
        "train.require_loss_decrease=false",
    ]
    first = Trainer(compose_job(common + ["train.steps=2"]))
    assert first.run() == 0
    lr_next = first.opt.param_groups[0]["lr"]  # what the run would have used at step 3
    ck = CheckpointManager(tmp_path / "run" / "checkpoints")
    marker = read_marker(ck.latest())
    assert marker["config"]["optim"]["lr"] == 0.002 and len(marker["tokenizer"]["sha256"]) == 64
    assert marker["architecture"]["text_config"]["vocab_size"] == 1024
    capsys.readouterr()

    # noted only: the batch, the packed length, the image size, the precision, lr and length
    noted = [
        "train.global_batch_size=4",
        "data.pack.seq_len=512",
        "data.image.max_pixels=8192",
        "train.precision=bf16",
        "optim.lr=0.001",
        "train.steps=8",
    ]
    Trainer(compose_job(common + noted)).close()
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.startswith("resume: ")]
    assert lines == [
        "resume: data.image.max_pixels: 16384 -> 8192",
        "resume: data.pack.seq_len: 1024 -> 512",
        "resume: optim.lr: 0.002 -> 0.001",
        "resume: train.global_batch_size: 2 -> 4",
        "resume: train.precision: fp32 -> bf16",
        "resume: train.steps: 2 -> 8",
    ]
    # the schedule's line: "was" is the lr the checkpoint's run had next (its optim.lr, not ours)
    was = float(re.search(r"\(was ([0-9.e+-]+)\)", out)[1])
    assert was == pytest.approx(lr_next, rel=1e-3)
    assert f"resumed from {ck.latest()} at step 2" in out

    # refused: another tokenizer (same size, two ordinary ids swapped) and another architecture
    tok = json.loads((sample_dir() / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["th"], vocab["nt"] = vocab["nt"], vocab["th"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    other_tok = f"data.tokenizer={tmp_path / 'tokenizer.json'}"
    with pytest.raises(CheckpointError) as err:
        Trainer(compose_job(common + [other_tok, "model.num_layers=2", "train.steps=4"]))
    (line,) = str(err.value).splitlines()
    assert "written with another architecture and tokenizer" in line
    assert "architecture.text_config.num_hidden_layers: 3 -> 2" in line
    assert "train.resume_allow_changes=[architecture,tokenizer]" in line
    out = capsys.readouterr().out
    assert "resume: model.num_layers: null -> 2" in out
    assert f'resume: data.tokenizer: "" -> {tmp_path / "tokenizer.json"}' in out
    assert re.search(
        r"^resume: tokenizer: sha256 \w{12} \(.*\) -> sha256 \w{12} \(.*tokenizer.json\)$",
        out,
        re.M,
    )
    assert [p.name for p in ck.complete()] == ["step_00000002"]  # nothing set aside

    # allowed: the same tokenizer change with train.resume_allow_changes=[tokenizer] resumes
    allowed = Trainer(
        compose_job(common + [other_tok, "train.steps=4", "train.resume_allow_changes=[tokenizer]"])
    )
    assert allowed.step == 2
    allowed.close()
    out = capsys.readouterr().out
    assert "resume: tokenizer: sha256" in out and "resumed from" in out

    # a checkpoint of an older version (no record in its marker): resumed, one line says so
    path = ck.latest() / "COMPLETE.json"
    old_marker = {k: v for k, v in json.loads(path.read_text()).items() if k not in marker_record}
    path.write_text(json.dumps(old_marker))
    Trainer(compose_job(common + ["train.steps=4", "optim.lr=0.001"])).close()
    out = capsys.readouterr().out
    assert "records no config (an older version wrote it): not compared" in out
    assert "resume: optim.lr" not in out and "resumed from" in out
