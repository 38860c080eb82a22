"""The embedded default trains 50 steps in FP8 and its loss curve stays beside the fp32 one.

Three runs of the real Trainer on the sample data, one process, the same seed and batches: fp32,
`model.fp8=blockwise` and `model.fp8=mxfp8`, both through `model.fp8_backend=emulate` (the recipe's
exact numerics: our reference quantizers, dequantized operands, fp64 GEMMs; the Triton kernels equal
it within 1e-7 in tests/model/test_fp8.py and tests/kernels/, but run too slowly in the interpreter
for 50 steps).  Bounds on |loss - fp32 loss| (the loss is near 6): the mean over each 5-step window
within 0.03, every step within 0.05 and the last within 0.02; the FP8 runs must also have learned
(last loss below the first by more than 1).  The curves drift apart as float32 summation order
(which differs between CPU kinds and thread counts) flips FP8 roundings, so single steps spike:
measured max step / max window / last for blockwise and mxfp8, on 2026-11-29 (CPU kind not
recorded) 0.0130 / - / 0.0044 and 0.0181 / - / 0.0034; on an AMD EPYC (2026-11-30) 0.0323 /
0.0155 / 0.0108 and 0.0098 / 0.0073 / 0.0041.  The curves are printed side by side every 5 steps.
"""

from __future__ import annotations

import pytest
import torch

from moevlm.config import compose_job
from moevlm.data.sample_cache import ensure_sample
from moevlm.train.trainer import Trainer

# 150 training steps: left out of the fast tier (`-m "not slow"`)
pytestmark = pytest.mark.slow

STEPS = 50
RUNS = {
    "fp32": [],
    "blockwise": ["model.fp8=blockwise", "model.fp8_backend=emulate"],
    "mxfp8": ["model.fp8=mxfp8", "model.fp8_backend=emulate"],
}
WINDOW, WINDOW_GAP, STEP_GAP, LAST_GAP = 5, 0.03, 0.05, 0.02


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Two torch threads here, not the package's one: the curves' gaps depend on the reductions'
    order, and the figures above were measured with two threads (CI's two cores).  With one thread
    mxfp8's largest step gap was 0.0318 (the last 0.0037) on an earlier machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


class _NoWindow:
    def add(self, **kw):
        pass


def _losses(shards: str, run_dir: str, extra: list[str]) -> list[float]:
    tr = Trainer(
        compose_job(
            [
                f"data.shards={shards}",
                "data.num_workers=0",
                f"train.steps={STEPS}",
                f"train.run_dir={run_dir}",
                "train.tensorboard=false",
                "train.checkpoint_at_end=false",
                "train.checkpoint_every=0",
                "train.progress=false",
                *extra,
            ]
        )
    )
    try:
        while tr.step < STEPS:
            assert tr.train_step(_NoWindow())
        return list(tr.losses)
    finally:
        tr.close()


def test_fp8_loss_curves_follow_fp32(tmp_path):
    shards = str(ensure_sample()[0])
    curves = {name: _losses(shards, str(tmp_path / name), extra) for name, extra in RUNS.items()}
    print("step " + "".join(f"{name:>11s}" for name in curves))
    for s in range(0, STEPS, 5):
        print(f"{s + 1:4d} " + "".join(f"{c[s]:11.4f}" for c in curves.values()))
    ref = curves["fp32"]
    for name in ("blockwise", "mxfp8"):
        gaps = [abs(a - b) for a, b in zip(curves[name], ref)]
        windows = [sum(gaps[s : s + WINDOW]) / WINDOW for s in range(0, STEPS, WINDOW)]
        print(
            f"{name}: |loss - fp32| max {max(gaps):.4f}, max over {WINDOW}-step windows "
            f"{max(windows):.4f}, last {gaps[-1]:.4f}"
        )
        assert max(windows) <= WINDOW_GAP, (name, windows)
        assert max(gaps) <= STEP_GAP and gaps[-1] <= LAST_GAP, (name, max(gaps), gaps[-1])
        assert curves[name][0] - curves[name][-1] > 1.0, name
