"""Where a training step's time goes: per-component times and torch.profiler traces.

    prof = Profiling(job.train, model, device, run_dir, rank, log)   # after the model is built
    prof.begin_step(n); prof.start("data"); ...; prof.stop("data")   # the trainer's own phases
    prof.end_step(n)                   # one sync (CUDA), the step's intervals summed
    prof.after_step(n)                 # after the trainer took the step time: a finished trace
    record["components_s"] = prof.take_window()                 # when a metrics line is written
    prof.close()                       # the end-of-run table, a trace still open

`train.profile_components=true` times COMPONENTS (disjoint; with `other` they add up to the step)
through hooks on the model's modules; `train.profile_steps=A,B` writes a chrome trace of steps A..B
to `<run_dir>/profile/rank<R>_steps<A>-<B>.json`.  The components: docs/architecture.md.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moevlm.config.train_checks import parse_profile_steps
from moevlm.model.decoder import Head, TextAttention
from moevlm.model.moe import Experts, Router
from moevlm.model.strategies import Combine, Dispatch, Loss
from moevlm.model.vision import PatchMerger, VisionEncoder

COMPONENTS = (
    "data",
    "vision_encoder",
    "merger",
    "attention",
    "router",
    "dispatch",
    "experts",
    "combine",
    "lm_head_loss",
    "backward",
    "grad_reduce_clip",
    "optimizer",
    "other",
)
_MODULES = (
    (VisionEncoder, "vision_encoder"),
    (PatchMerger, "merger"),
    (TextAttention, "attention"),
    (Router, "router"),
    (Experts, "experts"),
    (Dispatch, "dispatch"),
    (Combine, "combine"),
    (Head, "lm_head_loss"),
    (Loss, "lm_head_loss"),
)
# probed: absent = no recompute detection
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_autograd() -> bool:
    """True while the autograd engine runs (backward, and any recomputation inside it)."""
    return _graph_task_id is not None and _graph_task_id() != -1


# ---------------------------------------------------------------- clocks
class WallClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a

    def settle(self, last) -> None:
        pass


class CudaClock:
    """Events on the current stream; `settle` waits for the last one (the step's one sync)."""

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3

    def settle(self, last) -> None:
        last.synchronize()


# ---------------------------------------------------------------- timer
class ComponentTimer:
    """Nested named intervals of one step; `step_seconds` turns them into exclusive times per name."""

    def __init__(self, clock, ranges: bool = True):
        self.clock, self.ranges = clock, ranges
        self.handles: list = []
        self.names: list[str] = []
        self.starts: list[float] = []
        self.ends: list[float | None] = []
        self.parents: list[int] = []
        self.stack: list[int] = []
        self.ranges_open: list = []
        self.step_start = self.clock.mark()

    def reset(self) -> None:
        for held in (
            self.names,
            self.starts,
            self.ends,
            self.parents,
            self.stack,
            self.ranges_open,
        ):
            held.clear()
        self.step_start = self.clock.mark()

    def open(self, name: str) -> None:
        if self.ranges:
            rf = torch.autograd.profiler.record_function(f"moevlm.{name}")
            rf.__enter__()
            self.ranges_open.append(rf)
        self.parents.append(self.stack[-1] if self.stack else -1)
        self.stack.append(len(self.names))
        self.names.append(name)
        self.ends.append(None)
        self.starts.append(self.clock.mark())

    def close(self, name: str) -> None:
        i = self.stack.pop()
        self.ends[i] = self.clock.mark()
        if self.names[i] != name:
            raise RuntimeError(
                f"profile: {name!r} closed while {self.names[i]!r} was open (unbalanced hooks)"
            )
        if self.ranges:
            self.ranges_open.pop().__exit__(None, None, None)

    def step_seconds(self) -> tuple[dict[str, float], float]:
        """({component: exclusive seconds}, the step's measured seconds) since `reset`."""
        end = self.clock.mark()
        self.clock.settle(end)
        incl = [self.clock.seconds(a, b) for a, b in zip(self.starts, self.ends)]
        out = dict.fromkeys(COMPONENTS, 0.0)
        top = 0.0
        for name, t, parent in zip(self.names, incl, self.parents):
            out[name] = out.get(name, 0.0) + t
            if parent >= 0:
                out[self.names[parent]] -= t
            else:
                top += t
        total = self.clock.seconds(self.step_start, end)
        out["other"] = total - top
        return out, total

    # -------------------------------------------------------- attaching
    def attach(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            for cls, name in _MODULES:
                if isinstance(module, cls):
                    self._hook(module, name)

    def _hook(self, module: torch.nn.Module, name: str) -> None:
        def pre(_module, _args):
            if not in_autograd():
                self.open(name)

        def post(_module, _args, _out):
            if not in_autograd():
                self.close(name)

        self.handles += [
            module.register_forward_pre_hook(pre),
            module.register_forward_hook(post, always_call=True),
        ]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


# ---------------------------------------------------------------- traces
class TraceWindow:
    """torch.profiler around steps first..last (CPU, + CUDA on a GPU), exported as a chrome trace."""

    def __init__(self, first: int, last: int, folder: Path, rank: int, device: torch.device, log):
        self.first, self.last, self.folder, self.rank, self.log = (
            first,
            last,
            Path(folder),
            rank,
            log,
        )
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof, self.done, self.begun, self.step = None, False, 0, 0

    def begin(self, step: int) -> None:
        if self.prof is None and not self.done and self.first <= step <= self.last:
            self.prof = torch.profiler.profile(
                activities=self.activities, record_shapes=False, with_stack=False
            )
            self.prof.__enter__()
            self.begun = step

    def end(self, step: int) -> None:
        self.step = step
        if self.prof is not None and step >= self.last:
            self.finish()

    def finish(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{self.rank}_steps{self.begun}-{self.step}.json"
        self.prof.export_chrome_trace(str(path))
        self.prof, self.done = None, True
        self.log.info(
            f"profile: torch.profiler trace of steps {self.begun}-{self.step} written to {path} "
            "(one per rank; open in https://ui.perfetto.dev or chrome://tracing)"
        )


# ---------------------------------------------------------------- the trainer's handle
class Profiling:
    """What the trainer calls; every method is a cheap no-op when both options are off."""

    def __init__(
        self, train_cfg, model: torch.nn.Module, device: torch.device, run_dir: Path, rank: int, log
    ):
        self.timing = bool(train_cfg.profile_components)
        window = parse_profile_steps(train_cfg.profile_steps, train_cfg.steps)
        self.trace = (
            None
            if window is None
            else TraceWindow(*window, Path(run_dir) / "profile", rank, device, log)
        )
        self.run_dir, self.rank, self.log = Path(run_dir), rank, log
        self.timer = None
        if self.timing or self.trace is not None:
            # a trace alone needs only the ranges
            cuda_clock = self.timing and device.type == "cuda"
            self.timer = ComponentTimer(CudaClock() if cuda_clock else WallClock())
            self.timer.attach(model)
        self.window = dict.fromkeys(COMPONENTS, 0.0)
        self.run_total = dict.fromkeys(COMPONENTS, 0.0)
        self.run_step_s, self.run_steps = 0.0, 0

    def begin_step(self, step: int) -> None:
        if self.trace is not None:
            self.trace.begin(step)
        if self.timer is not None:
            self.timer.reset()

    def start(self, name: str) -> None:
        if self.timer is not None:
            self.timer.open(name)

    def stop(self, name: str) -> None:
        if self.timer is not None:
            self.timer.close(name)

    def end_step(self, step: int) -> None:
        if self.timing:
            parts, total = self.timer.step_seconds()
            for name, s in parts.items():
                self.window[name] += s
                self.run_total[name] += s
            self.run_step_s += total
            self.run_steps += 1

    def after_step(self, step: int) -> None:
        """After the step's time is taken: a trace whose last step this was is written."""
        if self.trace is not None:
            self.trace.end(step)

    def take_window(self) -> dict[str, float] | None:
        """Seconds per component summed over the steps since the last call (None when not timing)."""
        if not self.timing:
            return None
        out = {k: round(v, 6) for k, v in self.window.items()}
        self.window = dict.fromkeys(COMPONENTS, 0.0)
        return out

    def table(self) -> str:
        total = max(self.run_step_s, 1e-12)
        lines = [
            f"Per-component time of rank {self.rank} over {self.run_steps} steps "
            f"({self.run_step_s:.3f} s measured; moevlm/train/profile.py says what each row holds).",
            "",
            "| component | seconds | % of step time |",
            "|---|---:|---:|",
        ]
        lines += [f"| {k} | {v:.4f} | {100 * v / total:.1f} |" for k, v in self.run_total.items()]
        lines.append(f"| step (measured) | {self.run_step_s:.4f} | 100.0 |")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Writes the end table (profile_components.md on rank 0) and finishes a trace still open."""
        if self.trace is not None:
            self.trace.finish()
        if self.timing and self.run_steps:
            table = self.table()
            name = (
                "profile_components.md"
                if self.rank == 0
                else f"profile_components_rank{self.rank}.md"
            )
            (self.run_dir / name).write_text(table)
            self.log.info(table.rstrip())
            self.timing = False  # written once
        if self.timer is not None:
            self.timer.detach()
            self.timer = None
