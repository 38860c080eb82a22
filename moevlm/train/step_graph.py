"""Whole-step CUDA graphs (`train.cuda_graph=step`): the step's gradients (every micro-batch's forward
and backward, the gradient reduction, the clip) captured as one graph and the optimizer step as a
second, replayed from then on.

    graph = StepGraph(gradients_fn, optimizer, model_cfg, device, warmup=3)   # the trainer, once
    loss_sum, aux_sum, counts, norm = graph.gradients(micro, loss_tokens)     # eager, then captured
    graph.update()                                                            # optimizer.step(), likewise

Static inputs: one device buffer per micro-batch input, filled by a host-to-device copy before each
replay; `cu_seqlens` and the images' layout (`vision_layout`, laid out here from the grids) go to
the device too and the model reads nothing back (`inputs_checked`: the checks ran here on the host
copies).  Off CUDA (`capture=False`) the same buffers and functions run eagerly: the CPU tests
check what a capture would record.  Why and what is refused: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from moevlm.data.batch import MicroBatch
from moevlm.model.vision import VisionLayout
from moevlm.model.vlm import check_inputs, image_layout


def host_inputs(mb: MicroBatch, model_cfg) -> dict:
    """The model's keyword arguments as a captured step fills them, on the host: the micro-batch's
    tensors, its images or videos laid out (`vision_layout`), the host checks done (`inputs_checked`;
    the visual token counts, which vary, are then not needed)."""
    kwargs = {**mb.forward_kwargs(), "visual_tokens": None, "inputs_checked": True}
    if mb.pixel_values is not None and mb.pixel_values_videos is not None:
        raise RuntimeError(
            "train.cuda_graph=step lays out images or videos, not a micro-batch holding both"
        )
    if mb.pixel_values is not None:
        kwargs["vision_layout"] = image_layout(model_cfg, mb.pixel_values, mb.image_grid_thw)
    elif mb.pixel_values_videos is not None:
        kwargs["vision_layout"] = image_layout(model_cfg, mb.pixel_values_videos, mb.video_grid_thw)
    return kwargs


def captured_inputs(mb: MicroBatch, model_cfg, device: torch.device) -> dict:
    """`host_inputs` with every tensor on `device` (`cu_seqlens` and the layout included), but the
    image grids: what the model is called with (shapes only are read from the grids)."""
    kwargs = host_inputs(mb.to(device), model_cfg)
    if kwargs["cu_seqlens"] is not None:
        kwargs["cu_seqlens"] = kwargs["cu_seqlens"].to(device, non_blocking=True)
    if "vision_layout" in kwargs:
        kwargs["vision_layout"] = kwargs["vision_layout"].to(device)
    return kwargs


class StepGraph:
    """The two graphs of a step and their static inputs (see the module docstring).  `gradients_fn`
    (inputs per micro-batch, loss tokens as a 0-d tensor) -> a tuple of tensors (or None)."""

    def __init__(
        self,
        gradients_fn: Callable,
        optimizer: torch.optim.Optimizer,
        model_cfg,
        device: torch.device,
        warmup: int = 3,
        capture: bool | None = None,
    ):
        self.gradients_fn, self.opt, self.cfg = gradients_fn, optimizer, model_cfg
        self.device, self.warmup = device, warmup
        self.capture = device.type == "cuda" if capture is None else capture
        self.eager_steps = 0  # gradients computed eagerly (the warm-up)
        self.replays = 0  # gradients computed by replaying the graph
        self.static: list[dict] | None = None  # the micro-batches' buffers
        self.loss_tokens = torch.zeros((), dtype=torch.float32, device=device)
        self.outputs: tuple | None = None  # what the gradients graph writes
        self.grads_graph: torch.cuda.CUDAGraph | None = None
        self.update_graph: torch.cuda.CUDAGraph | None = None
        self.lrs: list[torch.Tensor] = []  # each parameter group's lr, read by the update graph
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.side = torch.cuda.Stream(device) if self.capture else None
        # the device memory a replay uses: its capture's peak (replays allocate nothing the
        # allocator sees, but run in the pool the capture filled)
        self.peak_gib = 0.0
        if self.capture:
            _capturable(self.opt)

    @property
    def captured(self) -> bool:
        """The gradients are the graph's (static buffers): the trainer must not set them to None."""
        return self.static is not None

    def gradients(self, micro: list[MicroBatch], loss_tokens: float) -> tuple:
        """(loss sum, aux share, expert counts, gradient norm) of the step's micro-batches."""
        for mb in micro:
            check_inputs(self.cfg, **mb.forward_kwargs())  # host copies: no read from the device
        if self.eager_steps < self.warmup:
            self.eager_steps += 1
            tokens = torch.tensor(float(loss_tokens), device=self.device)
            with self._on_side_stream():
                inputs = [captured_inputs(mb, self.cfg, self.device) for mb in micro]
                return self.gradients_fn(inputs, tokens)
        self._fill(micro, loss_tokens)
        if self.outputs is None:
            self.outputs, self.grads_graph = self._record(
                lambda: self.gradients_fn(self.static, self.loss_tokens)
            )
        elif self.grads_graph is not None:
            self.grads_graph.replay()
        else:  # capture=False: what the graph runs, eagerly, over the same buffers (a replay
            # writes the gradients its capture made, starting from none)
            self.opt.zero_grad(set_to_none=True)
            self.outputs = self.gradients_fn(self.static, self.loss_tokens)
        self.replays += 1
        # copies: a caller keeping them past the next replay keeps this step's values
        return tuple(None if t is None else t.clone() for t in self.outputs)

    def update(self) -> None:
        """The optimizer step at the groups' current lr: eager until the gradients are captured."""
        if not self.captured:
            with self._on_side_stream():
                self.opt.step()
            return
        if self.update_graph is None and self.capture:
            floats = [g["lr"] for g in self.opt.param_groups]
            self.lrs = [torch.tensor(float(lr), device=self.device) for lr in floats]
            for g, lr in zip(self.opt.param_groups, self.lrs):
                g["lr"] = lr
            try:
                _, self.update_graph = self._record(self.opt.step)
            finally:
                for g, lr in zip(self.opt.param_groups, floats):
                    g["lr"] = lr
            return
        if self.update_graph is None:
            self.opt.step()
            return
        for g, lr in zip(self.opt.param_groups, self.lrs):
            lr.fill_(float(g["lr"]))
        self.update_graph.replay()

    def describe(self) -> str:
        state = "captured" if self.captured else f"eager for {self.warmup} steps"
        return f"train.cuda_graph=step: {state}, {self.replays} replays"

    # --------------------------------------------------------------- internals
    def _fill(self, micro: list[MicroBatch], loss_tokens: float) -> None:
        """This step's host inputs copied into the static buffers (the first captured step makes them)."""
        self.loss_tokens.fill_(float(loss_tokens))
        if self.static is None:
            self.static = [captured_inputs(mb, self.cfg, self.device) for mb in micro]
            return
        if len(micro) != len(self.static):
            raise RuntimeError(
                f"train.cuda_graph=step captured {len(self.static)} micro-batches per step, got {len(micro)}"
            )
        for static, mb in zip(self.static, micro):
            for key, value in host_inputs(mb, self.cfg).items():
                held = static.get(key)
                if isinstance(held, VisionLayout) and isinstance(value, VisionLayout):
                    held.copy_(value)
                elif isinstance(value, torch.Tensor) and isinstance(held, torch.Tensor):
                    if value.shape != held.shape or value.dtype != held.dtype:
                        raise RuntimeError(
                            f"train.cuda_graph=step: {key} is {tuple(value.shape)} {value.dtype}, captured "
                            f"as {tuple(held.shape)} {held.dtype}; the packer's budgets fix every shape"
                        )
                    held.copy_(value, non_blocking=True)
                elif (value is None) != (held is None) or (
                    not isinstance(value, torch.Tensor) and value != held
                ):
                    raise RuntimeError(
                        f"train.cuda_graph=step: {key}={value!r} differs from the captured {held!r}"
                    )

    def _record(self, fn: Callable) -> tuple:
        """(fn's outputs, the graph that wrote them): captured and replayed once on CUDA."""
        if not self.capture:
            return fn(), None
        graph = torch.cuda.CUDAGraph()
        # (thread_local: the loader's pinning thread may allocate host memory meanwhile)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        graph.replay()  # a capture records without running
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.peak_gib = max(self.peak_gib, peak)
        return out, graph

    def _on_side_stream(self):
        """The warm-up's eager steps run on a side stream, as capture requires."""
        if self.side is None:
            return contextlib.nullcontext()
        return _side(self.side)


@contextlib.contextmanager
def _side(stream: torch.cuda.Stream):
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


def _capturable(opt: torch.optim.Optimizer) -> None:
    """Every group steps with device-side step counters (torch's `capturable`), those already made on
    the host moved to their parameter's device."""
    for group in opt.param_groups:
        group["capturable"] = True
        for p in group["params"]:
            state = opt.state.get(p, {})
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(p.device, torch.float32)


__all__ = ["StepGraph", "captured_inputs", "host_inputs"]
