"""`JobPlan`: what a validated job decided, the one object the build and the training loop read.

plan = validate(compose_job(["parallel.ep=2"]), world_size=2)
model, ctx = build_model(plan.model, plan.dims, plan.build)
plan.train.steps, plan.grad_accum, plan.dispatcher.name, plan.notes
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moevlm.config.schema import JobConfig
from moevlm.dispatch import DispatcherSpec
from moevlm.model.config import VLMConfig
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.pipeline_split import PipelineSplit


@dataclass
class JobPlan:
    """The job's sections as typed objects, the model config they compose, the layout, the accumulation
    (= the pipeline's micro-batches per step), the build options (with the pipeline stages and the
    dispatcher), and notes for the log (valid but probably unintended settings, and what an `auto`
    setting chose when not the obvious)."""

    job: JobConfig  # the typed sections, interpolations resolved
    model: VLMConfig
    dims: ParallelDims
    grad_accum: int
    build: BuildOptions
    notes: list[str] = field(default_factory=list)

    @property
    def pipeline(self) -> PipelineSplit | None:
        return self.build.pipeline

    @property
    def dispatcher(self) -> DispatcherSpec:
        return self.build.dispatcher

    @property
    def train(self):
        return self.job.train

    @property
    def optim(self):
        return self.job.optim

    @property
    def data(self):
        return self.job.data
