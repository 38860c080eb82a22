"""Launch and input mistakes are one `config error:` line, exit 2, no traceback: weight files of
model.hf_checkpoint whose safetensors header is truncated or absurd (found at start-up from the header,
naming the file), and a launch environment that cannot form a process group (WORLD_SIZE > 1 without
MASTER_ADDR, RANK >= WORLD_SIZE): said at once, not after a rendezvous waits 2 x parallel.timeout_s."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.model.config import VLMConfig
from moevlm.model.hf import safetensors_problem

REPO = Path(__file__).resolve().parents[2]
TINY_HF = json.dumps(VLMConfig.preset("tiny").to_hf("float32"))


def _checkpoint(root: Path, damage: str) -> tuple[Path, str]:
    """A folder with the tiny preset's config.json and a weight file damaged as `damage` says; the
    damaged file's name."""
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(TINY_HF)
    name = "model.safetensors"
    if damage == "sharded_truncated":
        name = "model-00002-of-00002.safetensors"
        index = {"a": "model-00001-of-00002.safetensors", "b": name}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        save_file({"a": torch.zeros(10)}, str(ckpt / index["a"]))
    save_file({"b": torch.zeros(1000)}, str(ckpt / name))
    data = (ckpt / name).read_bytes()
    cut = {
        "truncated": data[:-1000],
        "sharded_truncated": data[:-1000],
        "absurd_header": (2**62).to_bytes(8, "little") + data[8:],
        "header_not_json": (8).to_bytes(8, "little") + b"not json" + data[16:],
        "three_bytes": data[:3],
    }[damage]
    (ckpt / name).write_bytes(cut)
    return ckpt, name


SAYS = {
    "truncated": "its tensors need 4,000 bytes of data, the file holds 3,000 (truncated)",
    "sharded_truncated": "its tensors need 4,000 bytes of data, the file holds 3,000 (truncated)",
    "absurd_header": "its header claims 4,611,686,018,427,387,904 bytes (the file has",
    "header_not_json": "its header is not JSON: not a safetensors file, or damaged",
    "three_bytes": "3 bytes, too short for a safetensors header (truncated?)",
}


@pytest.mark.parametrize("damage", SAYS)
def test_a_damaged_weight_file_is_one_config_error_naming_it(tmp_path, damage):
    ckpt, name = _checkpoint(tmp_path, damage)
    with pytest.raises(ConfigError) as err:
        validate(compose_job([f"model.hf_checkpoint={ckpt}"]))
    lines = str(err.value).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"model.hf_checkpoint={ckpt}: {name} {SAYS[damage]}"), lines
    assert lines[0].endswith("; download or export it again")


def test_a_sound_file_has_no_problem(tmp_path):
    save_file(
        {"a": torch.zeros(3, 5), "b": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "m")
    )
    assert safetensors_problem(tmp_path / "m") is None


def _train_py(tmp_path: Path, args: list[str], **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "MOEVLM_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO), **env}
    for name in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_py_says_a_truncated_weight_file_in_one_line(tmp_path):
    ckpt, name = _checkpoint(tmp_path, "truncated")
    before = (ckpt / name).read_bytes()
    r = _train_py(tmp_path, ["model.hf_checkpoint=ckpt", "train.steps=1"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"config error: model.hf_checkpoint=ckpt (= {ckpt}): {name} {SAYS['truncated']}; download "
        "or export it again"
    ]
    assert "Traceback" not in r.stdout and (ckpt / name).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no run directory, no cache


@pytest.mark.parametrize(
    "env, says",
    [
        (
            {"WORLD_SIZE": "2", "RANK": "0"},
            "WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set: the ranks could not find each "
            "other; launch with torchrun",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"},
            "RANK=2 but WORLD_SIZE=2: ranks are 0..1; launch with torchrun",
        ),
    ],
    ids=["no_master_addr", "rank_too_large"],
)
def test_a_launch_environment_mistake_is_one_line_at_once(tmp_path, env, says):
    t0 = time.perf_counter()
    r = _train_py(tmp_path, ["train.steps=1", "parallel.timeout_s=600"], **env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {says}"), r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert time.perf_counter() - t0 < 120  # (not 2 x 600 s)
    assert list(tmp_path.iterdir()) == []


def test_launch_problem_cases():
    spec = importlib.util.spec_from_file_location("train_cli", REPO / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    ok = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert train.launch_problem({}) is None and train.launch_problem(ok) is None
    assert train.launch_problem({"RANK": "0", "LOCAL_RANK": "1"}) is None  # a device choice
    for env, start in [
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a whole number >= 1"),
        ({"RANK": "-1"}, "RANK='-1' is not a whole number >= 0"),
        ({"RANK": "1"}, "RANK=1 but WORLD_SIZE=1"),
        ({**ok, "RANK": "4"}, "RANK=4 but WORLD_SIZE=4"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK, MASTER_ADDR and MASTER_PORT are not set"),
        ({**ok, "MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not a port number"),
        ({**ok, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2"),
    ]:
        assert (train.launch_problem(env) or "").startswith(start), (env, train.launch_problem(env))
