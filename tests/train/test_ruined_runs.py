"""A launch whose weights were ruined exits 3 with one line naming why, however few steps it took:
most of its steps skipped as non-finite, or the model collapsed to a constant prediction (the issue's
`optim.lr=1e6`); NaN in imported weights is named at load, file and tensor, not blamed on an update."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import FAST

from moevlm.config import compose_job
from moevlm.model import Qwen3VLMoe, VLMConfig
from moevlm.model.hf import CheckpointError as HFCheckpointError
from moevlm.train.exit_codes import ExitCode
from moevlm.train.trainer import Trainer, collapsed, ruined_by_skips


def test_most_and_collapsed_are_defined_exactly():
    assert ruined_by_skips(10, 5, 0) is None  # half is not most
    assert ruined_by_skips(1, 0, 0) is None and ruined_by_skips(0, 0, 4) is None
    assert "every step of this launch (5..5) was skipped" in ruined_by_skips(1, 1, 4)
    assert "6 of the 10 steps of this launch (1..10) were skipped" in ruined_by_skips(10, 6, 0)
    ln = math.log(1024)
    assert "collapsed to a constant prediction" in collapsed(ln, 0.0, 1024)
    assert collapsed(ln, 1e-3, 1024) is None  # a gradient left: it can still train
    assert collapsed(ln * 0.99, 0.0, 1024) is None  # not the uniform prediction's loss


def test_a_huge_lr_exits_3_naming_why(tmp_path, capsys):
    """optim.lr=1e6 (the issue's trial): step 1 collapses the model (loss ln(1024), gradient norm 0),
    later steps are non-finite and skipped.  2 steps: the collapse; 6 steps: most skipped."""
    common = FAST + [
        "optim.lr=1e6",
        "train.checkpoint_at_end=false",
        "train.tensorboard=false",
        "data.num_workers=0",
    ]
    short = Trainer(compose_job(common + ["train.steps=2", f"train.run_dir={tmp_path / 'a'}"]))
    assert short.run() == ExitCode.NONFINITE and short.nonfinite_steps == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("stopping")]
    assert "collapsed to a constant prediction (loss 6.9315 = ln(vocabulary 1024)" in line
    longer = Trainer(compose_job(common + ["train.steps=6", f"train.run_dir={tmp_path / 'b'}"]))
    assert longer.run() == ExitCode.NONFINITE
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("stopping")]
    assert "4 of the 6 steps of this launch (1..6) were skipped for non-finite" in line


def test_nan_in_imported_weights_is_named_at_load(tmp_path):
    """A NaN in model.hf_checkpoint: hf.CheckpointError (train.py: `config error:`, exit 2) naming
    the file and the tensor, before any step; never "an update made them so: lower optim.lr"."""
    torch.manual_seed(0)
    Qwen3VLMoe(VLMConfig.preset("tiny")).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    name = "model.language_model.norm.weight"
    tensors[name][3] = float("nan")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, path, metadata=meta)
    job = compose_job(
        FAST + [f"train.run_dir={tmp_path / 'run'}", f"model.hf_checkpoint={path.parent}"]
    )
    with pytest.raises(HFCheckpointError) as err:
        Trainer(job)
    (line,) = str(err.value).splitlines()
    assert f"non-finite values in {path}:{name}" in line and "optim.lr" not in line
