"""`validate(job, world_size)`: every check a composed job needs before anything is allocated, all
reported at once, and the `JobPlan` it decides.

    plan = validate(compose_job(["parallel.ep=2"]), world_size=2)   # ConfigError: one line a problem

Each rule is checked once, by the part that owns it: a model field by VLMConfig.validate (worded
in the job's keys by model_config), the data by moevlm.data.config, a layout by ParallelDims, the
dispatcher by choose_dispatcher; here, what only the whole job can see.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import get_type_hints

import torch
from omegaconf import OmegaConf

from moevlm.config.build_checks import (
    check_context_parallel,
    check_cuda_graphs,
    check_ep_overlap,
    check_fp8,
    check_light_state,
    check_lora,
    check_offload,
    check_optimizer_offload,
    check_recompute,
    check_step_graph,
)
from moevlm.config.dispatcher import choose_dispatcher, gate
from moevlm.config.environment import (
    WANDB_MISSING,
    check_hf_architecture,
    data_problem,
    environment_checks,
    wandb_installed,
)
from moevlm.config.job_plan import JobPlan
from moevlm.config.model_section import model_config
from moevlm.config.scale import scale_down
from moevlm.config.schema import JobConfig
from moevlm.config.train_checks import (
    check_batch,
    check_faults,
    check_optim,
    check_profile,
    check_validation,
)
from moevlm.data.checks import check_job_data, check_stream_layout, check_tokenizer
from moevlm.errors import Problems, check
from moevlm.fields import allowed, checked_elsewhere
from moevlm.model.config import VLMConfig
from moevlm.parallel.build import BuildOptions
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.offload import offload_setting
from moevlm.parallel.pipeline_schedules import schedule_name
from moevlm.parallel.pipeline_split import PipelineSplit, split_pipeline
from moevlm.parallel.recompute import recompute_setting

# the last line of a GPU recipe's refusal on a machine without CUDA: how to run its shape here
CPU_TRY = (
    "on this machine (no CUDA) a recipe runs scaled down with its parallel shape kept: add +scale=cpu after "
    "+experiment=NAME (python train.py +experiment=NAME +scale=cpu prints the torchrun line it needs)"
)


def validate(job, world_size: int = 1, environment: bool = True) -> JobPlan:
    """Every check that needs no allocation (config values, the launch, and with `environment` the
    device, packages and files the config names), all at once: ConfigError with one line per problem
    (each group of checks reports its first), in the order a user would fix them.  environment=False
    checks a recipe for another machine (a GPU recipe's arithmetic on a laptop)."""
    problems = Problems()
    run = problems.run
    p, t = job.parallel, job.train
    for key, values in choice_fields().items():
        value = OmegaConf.select(job, key) if OmegaConf.is_config(job) else _select(job, key)
        run(check, value in values, f"{key}={value!r}; choose one of {list(values)}")
    before = len(problems.lines)
    unavailable = run(gate, job.model, environment)
    if (
        len(problems.lines) > before
    ):  # such a recipe cannot run at all: its launch and layout do not matter
        problems.raise_any()
    run(check, t.wandb == "disabled" or wandb_installed(), WANDB_MISSING.format(mode=t.wandb))
    # parallel.scale_to rewrites the layout and batch
    scaled = run(scale_down, job, world_size, model_config)
    if scaled is None:  # the layout checks below would only repeat it
        problems.raise_any()
    run(
        check,
        p.world_size is None or p.world_size == world_size,
        f"this recipe is laid out for parallel.world_size={p.world_size} processes but {world_size} were "
        f"launched; launch {p.world_size} (torchrun --nnodes/--nproc-per-node) or set parallel.world_size=null "
        "and a layout that fits",
    )
    for env_check in environment_checks(job) if environment else ():
        run(env_check)
    run(
        check,
        p.dp_replicate == 1 or p.dp_mode == "fsdp",
        f"parallel.dp_replicate={p.dp_replicate} needs parallel.dp_mode=fsdp: ddp already replicates every "
        "weight on every data rank (it is all replicate, nothing sharded); use dp_mode=fsdp for HSDP or "
        "set parallel.dp_replicate=1",
    )
    dims = run(
        ParallelDims,
        world_size,
        tp=p.tp,
        cp=p.cp,
        pp=p.pp,
        dp=p.dp,
        ep=p.ep,
        etp=p.etp,
        dp_replicate=p.dp_replicate,
    )
    model = run(model_config, job.model)
    if dims is not None and model is not None:
        run(dims.check_model, model)
    if dims is not None:
        run(check_batch, t, dims)
    spec, dispatcher_notes, fp8 = None, [], None
    if dims is not None and model is not None:
        chosen = run(choose_dispatcher, job.model, model.moe, dims, unavailable, environment)
        if chosen is not None:
            spec, dispatcher_notes = chosen
            run(check_ep_overlap, job, model, dims, spec)
    notes = scaled + dispatcher_notes + (run(check_optim, job.optim, t.steps) or [])
    notes += run(check_validation, t, job.data) or []
    run(check_faults, p, t)
    run(check_recompute, job.model)
    run(check_offload, job)
    run(
        check,
        not (t.compile and job.model.attn_backend == "sdpa_per_doc"),
        "train.compile=true with model.attn_backend=sdpa_per_doc: its host loop over the documents would "
        "recompile every batch; use model.attn_backend=sdpa (or auto), or train.compile=false",
    )
    run(check_profile, t)
    if dims is not None:
        run(check_context_parallel, job, dims)
        run(check_lora, job, dims)
    if dims is not None and model is not None:
        run(data_problem, check_job_data, job.data, model, dims.dp, dims.tp, dims.cp)
        if spec is not None:
            run(check_cuda_graphs, job, model, dims, spec)
            run(check_step_graph, job, model, dims)
            fp8 = run(check_fp8, job, model, dims, spec, environment)
    if dims is not None:
        run(check_optimizer_offload, job, dims)
        # (a recipe checked for another machine: auto precision is bf16 there, as the planner takes it)
        run(check_light_state, job, dims, not environment or torch.cuda.is_available())
    if environment and dims is not None:
        run(data_problem, check_stream_layout, job.data, dims.dp)
    if environment and model is not None:
        run(data_problem, check_tokenizer, job.data, job.model.hf_checkpoint, model)
        if job.model.hf_checkpoint and os.path.isfile(
            os.path.join(job.model.hf_checkpoint, "config.json")
        ):
            run(check_hf_architecture, job.model.hf_checkpoint, model)
    if problems.lines and environment and not torch.cuda.is_available() and p.scale_to is None:
        run(check, p.world_size in (None, world_size), CPU_TRY)  # a recipe's launch size
    problems.raise_any()
    grad_accum = t.global_batch_size // (t.micro_batch_size * dims.dp)
    sections = OmegaConf.to_object(job) if OmegaConf.is_config(job) else job
    return JobPlan(
        job=sections,
        model=model,
        dims=dims,
        grad_accum=grad_accum,
        build=_build_options(
            sections, model, spec, fp8, _split_pipeline(job, model, dims, grad_accum)
        ),
        notes=notes,
    )


@functools.cache
def choice_fields(cls: type = JobConfig, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """`section.field` -> its values, for every `one_of` field whose values are checked here (not by an
    owner of its own: `checked_by`)."""
    hints, plain, values = (
        get_type_hints(cls, include_extras=True),
        get_type_hints(cls),
        allowed(cls),
    )
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(plain[f.name]):
            out.update(choice_fields(plain[f.name], f"{prefix}{f.name}."))
        elif f.name in values and not checked_elsewhere(hints[f.name]):
            out[f"{prefix}{f.name}"] = values[f.name]
    return out


def _select(job, key: str):
    node = job
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _build_options(job, model: VLMConfig, spec, fp8, pipeline) -> BuildOptions:
    """What the build reads of the job: the device and precision it will run with, the layout's
    choices, and the decided dispatcher, FP8 recipe and pipeline stages."""
    t, p, m = job.train, job.parallel, job.model
    cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    return BuildOptions(
        dp_mode=p.dp_mode,
        device_type="cuda" if cuda else "cpu",
        bf16=t.precision == "bf16" or (t.precision == "auto" and cuda),
        pipeline=pipeline,
        dispatcher=spec,
        recompute=recompute_setting(m),
        recompute_collectives=m.recompute_collectives,
        offload=offload_setting(m),
        compile=t.compile,
        compile_mode=t.compile_mode,
        cp_comm=p.cp_comm,
        ep_overlap=p.ep_overlap,
        fp8=fp8,
        fp8_modules=tuple(model.fp8.modules),
        cuda_graph_scope=tuple(str(s) for s in m.cuda_graph_scope),
        optimizer_offload=p.optimizer_offload,
        master_weights=job.optim.master_weights,
        reduce_dtype=getattr(torch, p.reduce_dtype),
    )


def _split_pipeline(
    job, model: VLMConfig, dims: ParallelDims, microbatches: int
) -> PipelineSplit | None:
    p, d = job.parallel, job.data
    schedule_name(p.pp_schedule)  # a misspelt schedule is refused whatever pp is
    if dims.pp == 1:
        check(
            p.pp_layers in ("auto", None) and p.vpp in (None, 1),
            "parallel.pp_layers / parallel.vpp describe pipeline stages but parallel.pp=1; set parallel.pp > 1 "
            "or leave them at auto / null",
        )
        return None
    return split_pipeline(
        model,
        pp=dims.pp,
        vpp=p.vpp,
        schedule=p.pp_schedule,
        layers=p.pp_layers,
        microbatches=microbatches,
        rows=job.train.micro_batch_size,
        seq_len=d.pack.seq_len,
        # the vision work stage 0 carries: images' and videos' patches alike
        max_patches=d.pack.max_patches + (d.pack.max_video_patches if d.pack.max_videos else 0),
        image_patches=d.image.max_pixels // d.image.patch_size**2,
        freeze_vision=job.model.freeze_vision,
    )


__all__ = ["choice_fields", "validate"]
