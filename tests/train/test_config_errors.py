"""Every mistake that can be seen before anything is allocated is reported at once, one `config error:`
line each, exit 2, before a process group, a run directory or the sample set exists."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

# override -> the words its line must hold
MISTAKES = {
    "train.device=cuda": "train.device=cuda but this torch build",
    "model.grouped_gemm=triton": "model.grouped_gemm=triton runs Triton kernels, which need a CUDA device; on the "
    "CPU use model.grouped_gemm=torch (or set TRITON_INTERPRET=1",
    "model.permute=triton": "model.permute=triton runs Triton kernels",
    "parallel.backend=nccl": "parallel.backend=nccl needs CUDA devices",
    "data.shards=/no/such/folder": "data.shards=/no/such/folder does not exist",
    "model.hf_checkpoint=/no/such/hf": "model.hf_checkpoint=/no/such/hf does not exist or is not a folder",
    "train.resume=/no/such/step_00000010": "train.resume=/no/such/step_00000010 does not exist",
    "optim.lr=nan": "optim.lr=nan must be a finite number > 0",
    "train.micro_batch_size=0": "train.micro_batch_size=0 must be >= 1",
    "parallel.timeout_s=-1": "parallel.timeout_s=-1",
    "train.nonfinite=ignore": "train.nonfinite='ignore'; choose one of",
    "model.attn_backend=flash": "model.attn_backend=flash needs the flash-attn package",
}


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if __import__("torch").cuda.is_available():
        pytest.skip("checks what a CPU-only machine reports")
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("checks what a machine without flash-attn reports")


def test_every_mistake_is_reported_at_once(no_interpreter):
    with pytest.raises(ConfigError) as err:
        validate(compose_job(list(MISTAKES)))
    lines = str(err.value).splitlines()
    for override, words in MISTAKES.items():
        assert sum(words in line for line in lines) == 1, (override, lines)
    assert len(lines) == len(MISTAKES), lines


@pytest.mark.parametrize("override", list(MISTAKES))
def test_each_mistake_alone_is_one_line(no_interpreter, override):
    with pytest.raises(ConfigError) as err:
        validate(compose_job([override]))
    assert str(err.value).splitlines() == [
        line for line in str(err.value).splitlines() if MISTAKES[override] in line
    ]


def test_triton_on_the_cpu_is_allowed_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate(compose_job(["model.grouped_gemm=triton"]))


@pytest.mark.slow
def test_train_py_prints_every_line_and_creates_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if __import__("torch").cuda.is_available():
        pytest.skip("checks what a CPU-only machine reports")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *MISTAKES, f"train.run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == len(MISTAKES) and all(
        line.startswith("config error: ") for line in lines
    ), lines
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == []  # no run dir, no sample set, no outputs/


def test_your_shards_tokenizer_is_found_and_fits_the_model(tmp_path):
    """Before any sample set or process group: shards without a tokenizer anywhere, and a tokenizer whose
    special tokens are not where the model expects them, are each one line (tests/train/test_cli_mistakes.py:
    the keys it names)."""
    from moevlm.data.sample_cache import ensure_sample

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "shard-000000.tar").write_bytes(bytes(1024))
    with pytest.raises(ConfigError) as err:  # a model the sample set's tokenizer does not fit
        validate(compose_job([f"data.shards={shards}", "model.preset=qwen3_vl_30b_a3b"]))
    (line,) = str(err.value).splitlines()
    assert "data.tokenizer" in line and "--tokenizer" in line and "model.hf_checkpoint" in line
    validate(compose_job([f"data.shards={shards}"]))  # the tiny model: the sample set's tokenizer

    tiny_tokenizer = ensure_sample()[0] / "tokenizer.json"
    with pytest.raises(ConfigError) as err:
        validate(
            compose_job(
                [
                    f"data.shards={shards}",
                    f"data.tokenizer={tiny_tokenizer}",
                    "model.preset=qwen3_vl_30b_a3b",
                ]
            ),
            environment=True,
        )
    (line,) = str(err.value).splitlines()  # every special token that is elsewhere, in one line
    assert line.startswith(f"the tokenizer {tiny_tokenizer} does not fit the model")
    assert line.count(" there but ") == 4 and "model.image_token_id=1020" in line
    # the tiny model: fits
    validate(compose_job([f"data.shards={shards}", f"data.tokenizer={tiny_tokenizer}"]))
