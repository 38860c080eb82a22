"""Optional Weights & Biases logging (train.wandb, moevlm.train.wandb_log).

Most tests put `FakeWandb`, a TEST DOUBLE, in place of the `wandb` package: it
records what the trainer calls (`init(**kwargs)`, `run.log(dict, step=)`,
`run.finish()`) against wandb's documented API, so the wiring is checked where
wandb is not installed.  `test_real_wandb_offline_writes_under_run_dir` uses
the real package when it is installed (the `dev` extra brings it) and checks
the offline run's files under <run_dir>/wandb.
"""

from __future__ import annotations

import sys
import time
import types
from importlib.machinery import ModuleSpec

import pytest
from omegaconf import OmegaConf

from moevlm.config import compose_job, validate
from moevlm.errors import ConfigError
from moevlm.train.metrics import _TB_TAGS, MetricsLogger, step_record
from moevlm.train.wandb_log import run_id, start_wandb

FAST = ["data.num_workers=0", "data.streams=1", "train.log_every=1", "train.tensorboard=false"]


class FakeWandb(types.ModuleType):
    """Test double for the `wandb` package: records init kwargs and each run's log/finish calls."""

    def __init__(self, fail_log: bool = False):
        super().__init__("wandb")
        self.__spec__ = ModuleSpec("wandb", None)
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0
        self.fail_log = fail_log

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return FakeRun(self)


class FakeRun:
    def __init__(self, module: FakeWandb):
        self.module = module

    def log(self, data: dict, step: int | None = None) -> None:
        if self.module.fail_log:
            raise ConnectionError("upload refused\nsecond line")
        self.module.logged.append((dict(data), step))

    def finish(self) -> None:
        self.module.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake


def record(step: int, **kw) -> dict:
    args = dict(
        step=step,
        loss=2.0,
        lr=1e-3,
        step_time_s=1.0,
        useful_tokens=100,
        flops=1e12,
        world_size=1,
        peak_tflops=None,
        grad_norm=0.5,
        skipped={"too_long": 2},
    )
    return step_record(**{**args, **kw})


def test_missing_package_is_one_config_line(monkeypatch):
    # `import wandb` fails as when it is not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError) as err:
        validate(compose_job(["train.wandb=offline"]))
    msg = str(err.value)
    assert "\n" not in msg and "train.wandb='offline'" in msg and "pip install wandb" in msg
    assert "train.wandb=disabled" in msg
    validate(compose_job([]))  # the default needs no package
    with pytest.raises(
        ConfigError, match=r"train.wandb='off'; choose one of \['disabled', 'online', 'offline'\]"
    ):
        validate(compose_job(["train.wandb=off"]))


def test_trainer_logs_the_tensorboard_scalars_to_wandb(tmp_path, fake_wandb):
    """The trainer's W&B run: init with the job config, a run-dir id and resume=allow; one log per record
    with step= and the TensorBoard tags; finish at the end.  A relaunch gets the same id."""
    from moevlm.train.trainer import Trainer

    job = compose_job(
        FAST
        + [
            "train.steps=2",
            f"train.run_dir={tmp_path}",
            "train.global_batch_size=1",
            "train.wandb=offline",
            "train.wandb_project=proj",
            "train.checkpoint_at_end=false",
            # validation after the last step: its loss reaches W&B with that step's scalars
            "data.val_shards=sample",
            "train.val_every=2",
            "train.val_batches=1",
        ]
    )
    assert Trainer(job).run() == 0
    (init,) = fake_wandb.inits
    assert (
        init["config"] == OmegaConf.to_container(job, resolve=True)
        and init["config"]["train"]["wandb"] == "offline"
    )
    assert (
        init["id"] == run_id(tmp_path) and init["resume"] == "allow" and init["mode"] == "offline"
    )
    assert (
        init["dir"] == str(tmp_path)
        and init["project"] == "proj"
        and init["name"] == "/".join(tmp_path.parts[-2:])
    )
    assert [step for _, step in fake_wandb.logged] == [1, 2]
    for data, _ in fake_wandb.logged:
        assert (
            {
                "train/loss",
                "train/lr",
                "perf/tokens_per_s",
                "perf/tflops",
                "perf/step_time_s",
                "memory/peak_gib",
                "data/bad_samples",
                "data/tokens",
                "data/images",
                "data/image_tokens",
            }
            <= data.keys()
            <= set(_TB_TAGS.values())
            | {"data/bad_samples/too_long"}
            # the per-layer expert load of the tiny model's three MoE layers
            | {f"moe/load_max_over_mean/layer_{i}" for i in range(3)}
        )
        assert "perf/mfu" not in data  # null on CPU: left out, as in TensorBoard
    assert ["val/loss" in data for data, _ in fake_wandb.logged] == [False, True]
    assert fake_wandb.finished == 1
    assert (
        start_wandb(job, tmp_path, rank=0).run is not None
        and fake_wandb.inits[1]["id"] == init["id"]
    )
    assert start_wandb(job, tmp_path, rank=1) is None and len(fake_wandb.inits) == 2


def test_resume_note_and_failures_do_not_stop_logging(tmp_path, fake_wandb, capsys):
    job = compose_job(["train.wandb=online"])
    with MetricsLogger(
        tmp_path, 0, 10, 1, tensorboard=False, progress=False, wandb=start_wandb(job, tmp_path, 0)
    ) as log:
        for step in (1, 2, 3):
            log.log(record(step))
    assert [(d["data/bad_samples/too_long"], s) for d, s in fake_wandb.logged] == [
        (2, 1),
        (2, 2),
        (2, 3),
    ]
    fake_wandb.fail_log = True
    with MetricsLogger(
        tmp_path, 0, 10, 1, tensorboard=False, progress=False, wandb=start_wandb(job, tmp_path, 0)
    ) as log:
        assert log.resume_at(1) == 2
        log.log(record(2))
        log.log(record(3))
    out, err = capsys.readouterr()
    assert (
        "W&B cannot drop history: its steps 2..3 keep the values logged before this resume" in out
    )
    (line,) = err.splitlines()  # one line, then W&B is off; metrics.jsonl goes on
    assert line.startswith("W&B logging failed (ConnectionError: upload refused); W&B is off")
    assert [r.split(",")[0] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        '{"step": 1'
    ] + ['{"step": 2', '{"step": 3']
    assert fake_wandb.finished == 1  # the failed run is not finished again


def test_real_wandb_offline_writes_under_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    run_dir = tmp_path / "run"
    job = compose_job(["train.wandb=offline"])
    with MetricsLogger(
        run_dir, 0, 10, 1, tensorboard=False, progress=False, wandb=start_wandb(job, run_dir, 0)
    ) as log:
        log.log(record(1))
        log.log(record(2, loss=float("nan")))
    (folder,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id(run_dir)}")
    tags = [
        t.encode()
        for t in ("train/loss", "perf/tflops", "data/bad_samples/too_long", "wandb_project")
    ]
    # wandb 0.31's service may finish writing the file just after finish()
    deadline = time.monotonic() + 120  # a hang bound: a busy machine writes late
    while True:
        # protobuf records: keys are plain UTF-8
        data = (folder / f"run-{run_id(run_dir)}.wandb").read_bytes()
        if all(t in data for t in tags) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [t for t in tags if t not in data] == []  # the scalars' tags and the job config
