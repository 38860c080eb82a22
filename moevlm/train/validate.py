"""Validation of a composed job: every check that needs no allocation, all reported at once, and
the Plan it derives (the model config, the layout, the accumulation, the pipeline stages).

    plan = validate(compose_job(["parallel.ep=2"]), world_size=2)   # ConfigError: one line a problem

Design choices:
- `validate()` checks everything that needs no file or device and says what to change; files
  (shards, tokenizer, checkpoints) are checked where opened.  Every number is range-checked so that
  NaN fails too (Python compares NaN False) and infinities are refused; settings that are valid but
  probably unintended (warmup longer than the run) become `Plan.notes` for the log.
- Each rule is checked once, at the boundary that owns it: a model field by VLMConfig.validate
  (through moevlm.train.schema.model_config, which words its errors in the job's keys), the data by
  moevlm.data.config and moevlm.data.loader.check_config, a layout by ParallelDims; this module
  checks what only the whole job can see (combinations of sections, the launch, the machine).
- `model.dispatcher=auto` (the default) is resolved once, here, from the layout: `local` when
  parallel.ep x etp == 1, else `alltoall`; the Plan's model config carries the concrete name (a
  note says when auto chose alltoall).  An explicit name wins; `local` with ep > 1 is refused.
  The names are the registry's (moevlm.dispatch.DISPATCHERS); the gated ones (deepep, hybridep:
  moevlm.dispatch.availability, package, adapter, layout rules) are refused with the reason, or
  replaced by `model.dispatcher_fallback` with one note.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from moevlm.data.checks import (
    check_job_data,
    check_shards,
    check_stream_layout,
    check_tokenizer,
    shown_path,
)
from moevlm.dispatch import dispatcher_names
from moevlm.dispatch.availability import CLASSES as GATED_CLASSES
from moevlm.model.attention import varlen_available, varlen_missing
from moevlm.errors import ConfigError
from moevlm.model.config import VLMConfig
from moevlm.model.fp8 import BLOCK
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.optimizer_offload import offload_kind
from moevlm.parallel.pipeline_plan import PipelinePlan, plan_pipeline, schedule_name
from moevlm.train.profile import parse_profile_steps
from moevlm.train.scale import scale_down
from moevlm.train.schema import CHOICES, _check, _int, _real, model_config
from moevlm.train.wandb_log import MISSING_PACKAGE as WANDB_MISSING
from moevlm.train.wandb_log import wandb_installed


@dataclass
class Plan:
    """What validation derived: the model config, the layout, the accumulation (= the pipeline's
    micro-batches per step), the pipeline stages (pp > 1), notes for the log."""

    model: VLMConfig
    dims: ParallelDims
    grad_accum: int
    pipeline: Optional[PipelinePlan] = None
    # for the log: valid but probably unintended settings, and what an `auto` setting chose when not the obvious
    notes: list[str] = field(default_factory=list)


def _check_recompute(m) -> None:
    from moevlm.parallel.recompute import check

    reason = check(m.recompute, tuple(m.recompute_modules or ()))
    if reason is not None:
        raise ConfigError(reason)


def _check_offload(job) -> None:
    """model.offload_modules: known scopes, not inside recomputed regions, nothing it cannot run with."""
    from moevlm.parallel.offload import GRAPH_OVERLAPS, check
    from moevlm.parallel.recompute import recompute_setting

    m = job.model
    modules = tuple(m.offload_modules or ())
    if not modules:
        return
    reason = check(modules, recompute_setting(m))
    if reason is not None:
        raise ConfigError(reason)
    key = f"model.offload_modules=[{','.join(modules)}]"
    graphed = sorted(
        {g for s in modules for g in GRAPH_OVERLAPS[s]} & {str(s) for s in m.cuda_graph_scope}
    )
    refusals = [
        (
            bool(job.train.compile),
            "with train.compile=true: the offload's saved-tensor hooks copy on a side stream and wait on "
            "events from Python, which a compiled block cannot trace; use train.compile=false or "
            "model.offload_modules=[]",
        ),
        (
            bool(graphed),
            f"overlaps model.cuda_graph_scope {graphed}: a CUDA-graph capture cannot hold the host copies and "
            "stream waits of an offload scope (and the graph keeps its saved activations in its own pool); "
            "leave those scopes out of one of the two lists",
        ),
    ]
    _check(
        not any(bad for bad, _ in refusals),
        "\n".join(f"{key} {why}" for bad, why in refusals if bad),
    )


def validate(job, world_size: int = 1, environment: bool = True) -> Plan:
    """Every check that needs no allocation (config values, the launch, and with `environment` the
    device, packages and files the config names), all at once: ConfigError with one line per problem
    (each group of checks reports its first), in the order a user would fix them.  environment=False
    checks a recipe for another machine (a GPU recipe's arithmetic on a laptop)."""
    problems: list[str] = []
    run = _collector(problems)
    p, t, o = job.parallel, job.train, job.optim
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(job, section), name)
        run(_check, value in allowed, f"{key}={value!r}; choose one of {list(allowed)}")
    before = len(problems)
    unavailable = run(_dispatcher_unavailable, job.model, environment)
    # such a recipe cannot run at all: its launch size and layout do not matter
    if len(problems) > before:
        raise ConfigError("\n".join(problems))
    run(_check, t.wandb == "disabled" or wandb_installed(), WANDB_MISSING.format(mode=t.wandb))
    # parallel.scale_to rewrites the layout and batch
    scaled = run(scale_down, job, world_size, model_config)
    if scaled is None:  # the layout checks below would only repeat it
        raise ConfigError("\n".join(problems))
    run(
        _check,
        p.world_size is None or p.world_size == world_size,
        f"this recipe is laid out for parallel.world_size={p.world_size} processes but {world_size} were "
        f"launched; launch {p.world_size} (torchrun --nnodes/--nproc-per-node) or set parallel.world_size=null "
        "and a layout that fits",
    )
    for check in environment_checks(job) if environment else ():
        run(check)
    run(
        _check,
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
    dispatcher_note: list[str] = []
    if dims is not None:
        run(_check_dispatcher, job.model.dispatcher, dims)
        run(_check_batch, t, dims)
    if dims is not None and model is not None:
        unavailable = unavailable or run(
            _dispatcher_layout_problem, job.model, dims, model.moe.num_experts, environment
        )
        model.moe.dispatcher, dispatcher_note = resolve_dispatcher(
            job.model.dispatcher, dims, unavailable, job.model.dispatcher_fallback
        )
        run(_check_capacity, job.model, model.moe.dispatcher, dims)
        run(_check_ep_overlap, job, model, dims)
    notes = scaled + dispatcher_note + (run(_check_optim, o, t.steps) or [])
    notes += run(_check_validation, t, job.data) or []
    run(_check_faults, p, t)
    run(_check_recompute, job.model)
    run(_check_offload, job)
    run(
        _check,
        not (t.compile and job.model.attn_backend == "sdpa_per_doc"),
        "train.compile=true with model.attn_backend=sdpa_per_doc: its host loop over the documents would "
        "recompile every batch; use model.attn_backend=sdpa (or auto), or train.compile=false",
    )
    run(_check_profile, t)
    if dims is not None:
        run(_check_context_parallel, job, dims)
    if dims is not None and model is not None:
        run(_data_problem, check_job_data, job.data, model, dims.dp, dims.tp, dims.cp)
        run(_check_cuda_graphs, job, model, dims)
        run(_check_fp8, job, model, dims, environment)
    if dims is not None:
        run(_check_optimizer_offload, job, dims)
    if environment and dims is not None:
        run(_data_problem, check_stream_layout, job.data, dims.dp)
    if environment and model is not None:
        run(_data_problem, check_tokenizer, job.data, job.model.hf_checkpoint, model)
        if job.model.hf_checkpoint and os.path.isfile(
            os.path.join(job.model.hf_checkpoint, "config.json")
        ):
            run(_check_hf_architecture, job.model.hf_checkpoint, model)
    if problems:
        raise ConfigError("\n".join(problems))
    grad_accum = t.global_batch_size // (t.micro_batch_size * dims.dp)
    return Plan(
        model=model,
        dims=dims,
        grad_accum=grad_accum,
        pipeline=_plan_pipeline(job, model, dims, grad_accum),
        notes=notes,
    )


def _collector(problems: list[str]):
    """run(fn, *args): fn's result, or None with its ConfigError's lines added to `problems`."""

    def run(fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            problems.extend(line for line in str(err).splitlines() if line not in problems)
            return None

    return run


# ---------------------------------------------------------- the environment
TRITON_OPTIONS = ("model.grouped_gemm", "model.permute")


def environment_checks(job) -> list:
    """Checks of what the config asks of this machine (device, backend, packages) and of the files it
    names; each a no-argument callable raising ConfigError, so every problem is reported."""
    t, m, p = job.train, job.model, job.parallel
    cuda = torch.cuda.is_available()
    on_cpu = t.device == "cpu" or not cuda  # (device=cuda without CUDA is its own error)
    checks = [
        lambda: _check(
            t.device != "cuda" or cuda,
            f"train.device=cuda but {_why_no_cuda()}; use train.device=auto (CPU here) or cpu",
        ),
        lambda: _check(
            p.backend != "nccl" or not on_cpu,
            "parallel.backend=nccl needs CUDA devices but this job runs on the CPU; use parallel.backend=auto "
            "(gloo on the CPU)",
        ),
    ]
    for key in TRITON_OPTIONS:
        value = getattr(m, key.split(".")[1])
        checks.append(
            lambda key=key, value=value: _check(
                value != "triton" or not on_cpu or os.environ.get("TRITON_INTERPRET") == "1",
                f"{key}=triton runs Triton kernels, which need a CUDA device; on the CPU use {key}=torch (or set "
                "TRITON_INTERPRET=1 before launching to run them in Triton's interpreter: very slow, for tests)",
            )
        )
    checks.append(
        lambda: _check(
            not m.cuda_graph_scope or not on_cpu,
            f"model.cuda_graph_scope={_scope(m)} captures CUDA graphs, which need a CUDA device; "
            "this job runs on the CPU: use model.cuda_graph_scope=[] (or train.device=cuda on a "
            "GPU machine)",
        )
    )
    checks.append(
        lambda: _check(
            m.attn_backend != "flash" or importlib.util.find_spec("flash_attn") is not None,
            "model.attn_backend=flash needs the flash-attn package, which is not installed "
            "(pip install flash-attn, CUDA only); use model.attn_backend=auto",
        )
    )
    checks.append(
        lambda: _check(
            m.attn_backend != "varlen" or (not on_cpu and varlen_available()),
            f"model.attn_backend=varlen needs {_varlen_needs(on_cpu)}; use "
            "model.attn_backend=auto (sdpa on the CPU)",
        )
    )
    checks += [
        lambda: _check_hf_checkpoint(m.hf_checkpoint),
        # (model.hf_config: read by model_config, which says when it is missing or unreadable)
        lambda: _check_path(
            "" if t.resume in ("auto", "none") else t.resume,
            "train.resume",
            "a checkpoint folder (checkpoints/step_NNNNNNNN), auto or none",
            folder=True,
        ),
        lambda: _data_problem(check_shards, job.data.shards),
        lambda: _data_problem(check_val_shards, job.data.val_shards),
    ]
    return checks


def _varlen_needs(on_cpu: bool) -> str:
    if on_cpu:
        return "a CUDA device (torch's varlen_attn is a flash-attention kernel) but this job runs on the CPU"
    return varlen_missing() or "a CUDA device"


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return f"no CUDA device is visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})"


def _check_path(path: str, key: str, what: str, folder: bool = False) -> None:
    if path:
        _check(
            os.path.isdir(path) if folder else os.path.exists(path),
            f"{key}={shown_path(path)} does not exist{' or is not a folder' if folder else ''}; "
            f"give {what}",
        )


HF_FOLDER = (
    "an HF Qwen3-VL-MoE folder (config.json, and model.safetensors or model.safetensors.index.json)"
)


def _check_hf_checkpoint(path: str) -> None:
    """model.hf_checkpoint holds a config and every weight file it needs (what the load opens after the
    model is built); the architecture is compared once the model config is known (`_check_hf_architecture`)."""
    from moevlm.model.hf import checkpoint_files

    _check_path(path, "model.hf_checkpoint", HF_FOLDER, folder=True)
    if not path:
        return
    key = f"model.hf_checkpoint={shown_path(path)}"
    _check(
        os.path.isfile(os.path.join(path, "config.json")),
        f"{key} has no config.json; give {HF_FOLDER}, or leave model.hf_checkpoint empty to start "
        "from random weights",
    )
    try:
        files = checkpoint_files(Path(path))
    except FileNotFoundError:
        raise ConfigError(
            f"{key} has a config.json but no weights (neither model.safetensors nor "
            f"model.safetensors.index.json); give {HF_FOLDER}, or set model.hf_config={os.path.abspath(path)} "
            "to take only its architecture (random weights)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{key}: model.safetensors.index.json cannot be read ({type(err).__name__}: {err}); it must "
            "be JSON with a weight_map"
        ) from None
    missing = [f.name for f in files if not f.is_file()]
    _check(
        not missing,
        f"{key}: model.safetensors.index.json names {len(missing)} weight file(s) that are not in the "
        f"folder, e.g. {missing[:3]}; copy them there (a download cut short?)",
    )


def _check_hf_architecture(path: str, model: VLMConfig) -> None:
    """The checkpoint's config.json describes the model being built (weights are copied by name and shape)."""
    from moevlm.model.hf import CheckpointError, check_architecture

    key = f"model.hf_checkpoint={shown_path(path)}"
    try:
        check_architecture(Path(path), model)
    except CheckpointError as err:
        raise ConfigError(f"{key}: {err}") from None
    except (ConfigError, OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{key}: its config.json is not a Qwen3-VL-MoE config ({type(err).__name__}: "
            f"{' '.join(str(err).split())})"
        ) from None


def _data_problem(check, *args) -> None:
    """`check` (moevlm.data.config) raises ValueError; here every problem is a ConfigError."""
    try:
        check(*args)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _plan_pipeline(
    job, model: VLMConfig, dims: ParallelDims, microbatches: int
) -> Optional[PipelinePlan]:
    p, d = job.parallel, job.data
    schedule_name(p.pp_schedule)  # a misspelt schedule is refused whatever pp is
    if dims.pp == 1:
        _check(
            p.pp_layers in ("auto", None) and p.vpp in (None, 1),
            "parallel.pp_layers / parallel.vpp describe pipeline stages but parallel.pp=1; set parallel.pp > 1 "
            "or leave them at auto / null",
        )
        return None
    return plan_pipeline(
        model,
        pp=dims.pp,
        vpp=p.vpp,
        schedule=p.pp_schedule,
        layers=p.pp_layers,
        microbatches=microbatches,
        rows=job.train.micro_batch_size,
        seq_len=d.pack.seq_len,
        max_patches=d.pack.max_patches,
        image_patches=d.image.max_pixels // d.image.patch_size**2,
        freeze_vision=job.model.freeze_vision,
    )


# the registry's (moevlm.dispatch): local first, then alphabetical
DISPATCHER_NAMES = dispatcher_names()
# named, but runnable only as moevlm.dispatch.availability says: the backends that need a deep_ep class
GATED_DISPATCHERS = tuple(GATED_CLASSES)


def resolve_dispatcher(
    name: str, dims: ParallelDims, unavailable: str | None = None, fallback: str = "none"
) -> tuple[str, list[str]]:
    """The concrete dispatcher for `model.dispatcher` (already checked) under `dims`, and the log line
    when `auto` chose one that moves tokens: `auto` is `local` when no token leaves its rank
    (ep x etp == 1), else `alltoall` (the built backend that runs everywhere); an explicit name wins,
    unless it is `unavailable` (the reason) and `fallback` names what runs instead: one note says so."""
    if unavailable is not None and fallback != "none":
        return fallback, [
            f"note: model.dispatcher={name} cannot run: {unavailable}; running the {fallback} "
            f"dispatcher instead (model.dispatcher_fallback={fallback})"
        ]
    if name != "auto":
        return name, []
    if dims.ep * dims.etp == 1:
        return "local", []
    return "alltoall", [
        f"model.dispatcher=auto chose alltoall: parallel.ep x etp = {dims.ep} x {dims.etp} > 1 "
        "moves tokens between ranks"
    ]


def _check_dispatcher(name: str, dims: ParallelDims) -> None:
    _check(
        name == "auto" or name in DISPATCHER_NAMES,
        f"model.dispatcher={name!r}; choose auto or one of {list(DISPATCHER_NAMES)}",
    )
    _check(
        name != "local" or dims.ep == 1,
        f"parallel.ep={dims.ep} moves tokens between ranks: model.dispatcher='local' cannot; choose alltoall "
        "(or auto)",
    )


def _check_capacity(m, dispatcher: str, dims: ParallelDims) -> None:
    """model.moe_capacity_factor is a mode of the alltoall and hybridep dispatchers, without ETP
    (moevlm.dispatch.capacity, moevlm.dispatch.hybridep)."""
    if m.moe_capacity_factor is None:
        return
    _check(
        dispatcher in ("alltoall", "hybridep"),
        f"model.moe_capacity_factor={m.moe_capacity_factor} is a mode of the alltoall and hybridep dispatchers "
        f"but the dispatcher is {dispatcher!r}; set model.dispatcher=alltoall, or model.moe_capacity_factor=null",
    )
    _check(
        dims.etp == 1,
        f"model.moe_capacity_factor={m.moe_capacity_factor} is not built with parallel.etp="
        f"{dims.etp} > 1; use parallel.etp=1, or model.moe_capacity_factor=null (dropless)",
    )


def _check_ep_overlap(job, model: VLMConfig, dims: ParallelDims) -> None:
    """What parallel.ep_overlap (moevlm.parallel.ep_overlap) cannot run with, each with its reason."""
    if not job.parallel.ep_overlap:
        return
    refusals = [
        (
            not model.moe.num_experts,
            "has no MoE layer to overlap (model.num_experts=0); leave it false",
        ),
        (
            dims.ep == 1,
            "needs expert parallel: parallel.ep=1 exchanges nothing; set parallel.ep > 1",
        ),
        (
            dims.etp > 1,
            f"is not built with expert tensor parallel (parallel.etp={dims.etp}); use parallel.etp=1",
        ),
        (
            model.moe.dispatcher != "alltoall",
            f"runs the alltoall dispatcher only, not {model.moe.dispatcher!r}; set "
            "model.dispatcher=alltoall (or auto)",
        ),
        (
            bool(job.train.compile),
            "with train.compile=true is not built (its exchanges are not kept out of the "
            "compiled graph); use train.compile=false",
        ),
        (
            "moe_preprocess" in [str(s) for s in job.model.cuda_graph_scope],
            "with model.cuda_graph_scope moe_preprocess: the overlap permutes two chunks of varying shape, which one "
            "captured graph cannot replay; leave moe_preprocess out",
        ),
    ]
    _check(
        not any(bad for bad, _ in refusals),
        "\n".join(f"parallel.ep_overlap=true {why}" for bad, why in refusals if bad),
    )


def _dispatcher_refusal(name: str, reason: str) -> str:
    return (
        f"model.dispatcher={name!r} cannot run: {reason}; use model.dispatcher=alltoall, or "
        "model.dispatcher_fallback=alltoall to fall back to it"
    )


def _dispatcher_unavailable(m, environment: bool) -> str | None:
    """Why a gated backend (deepep, hybridep) cannot run: its package on this machine (with `environment`),
    then moevlm's adapter.  Refused here, before any process group, unless model.dispatcher_fallback says
    what runs instead; then the reason, for the note."""
    from moevlm.dispatch.availability import unavailable_reason

    if m.dispatcher not in GATED_DISPATCHERS:
        return None
    api = m.deepep_api if m.dispatcher == "deepep" else "auto"
    reason = unavailable_reason(m.dispatcher, check_package=environment, api=api)
    _check(
        reason is None or m.dispatcher_fallback != "none", _dispatcher_refusal(m.dispatcher, reason)
    )
    return reason


def _dispatcher_layout_problem(
    m, dims: ParallelDims, num_experts: int, environment: bool
) -> str | None:
    """A gated backend's rank and expert-count rules (moevlm.dispatch.availability) under this layout; the
    node size is this machine's when checking it (DeepEP: the launch's LOCAL_WORLD_SIZE; HybridEP: its
    NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN, default 8), else unknown.  DeepEP's rules are the API's that
    will run (`model.deepep_api`; "auto": V2's where the package has it, V1's where not).  HybridEP's old
    NVLINK_DOMAIN_SIZE, which it no longer reads, is refused with the new name whatever the fallback."""
    from moevlm.dispatch.availability import (
        LAUNCH_NODE_SIZE,
        deepep_layout_problem,
        deepep_rules_api,
        hybridep_env_problem,
        hybridep_layout_problem,
    )

    if m.dispatcher not in GATED_DISPATCHERS or not num_experts:
        return None
    node = LAUNCH_NODE_SIZE[m.dispatcher]() if environment else None
    if m.dispatcher == "deepep":
        api = deepep_rules_api(m.deepep_api, environment)
        problem = deepep_layout_problem(dims.ep, num_experts, node, api)
    else:
        env = hybridep_env_problem() if environment else None
        _check(env is None, f"model.dispatcher='hybridep': {env}")
        problem = hybridep_layout_problem(dims.ep, num_experts, node)
    _check(
        problem is None or m.dispatcher_fallback != "none",
        _dispatcher_refusal(m.dispatcher, problem),
    )
    return problem


def _scope(m) -> str:
    return "[" + ",".join(str(s) for s in m.cuda_graph_scope) + "]"


def _check_cuda_graphs(job, model: VLMConfig, dims: ParallelDims) -> None:
    """What `model.cuda_graph_scope` cannot capture safely (moevlm.parallel.cuda_graphs), each with its reason."""
    from moevlm.parallel.cuda_graphs import scope_problem

    m, scope = job.model, [str(s) for s in job.model.cuda_graph_scope]
    if not scope:
        return
    key = f"model.cuda_graph_scope={_scope(m)}"
    problem = scope_problem(scope)
    _check(problem is None, f"{problem}")
    refusals = [
        (
            dims.world > 1 and job.parallel.dp_mode == "fsdp",
            "cannot run under FSDP (parallel.dp_mode=fsdp over several processes): FSDP2 frees the unsharded "
            "parameters after each use and allocates them again at the next all-gather, so their addresses change "
            "under a captured graph; use parallel.dp_mode=ddp",
        ),
        (
            dims.pp > 1,
            "cannot run with pipeline parallel (parallel.pp>1): a schedule runs several micro-batches' "
            "forwards before their backwards, and each replay overwrites the graph's saved activations and outputs; "
            "use parallel.pp=1",
        ),
        (
            dims.tp * dims.cp > 1,
            "cannot capture the tensor/context-parallel collectives; use parallel.tp=1 and cp=1",
        ),
        (
            bool(job.train.compile),
            "and train.compile=true both capture the same code (torch.compile brings its own CUDA graphs); "
            "choose one",
        ),
        (
            m.recompute != "none",
            "cannot run with model.recompute (recompute re-runs a graphed forward inside backward, which is not "
            "verified); use model.recompute=none",
        ),
        (
            ("attn" in scope or "full_layer" in scope) and m.attn_backend != "sdpa",
            f"captures attention with the sdpa backend only (its (B,1,S,S) mask is static; flash and varlen take "
            f"cu_seqlens of varying length, flex a block mask); model.attn_backend={m.attn_backend}: set "
            "model.attn_backend=sdpa",
        ),
        (
            "full_layer" in scope and dims.ep * dims.etp > 1,
            "full_layer needs a static, sync-free layer, but the alltoall dispatcher (parallel.ep x etp > 1) moves a "
            "data-dependent number of tokens after a host sync; use attn, moe_router, moe_preprocess",
        ),
        (
            "full_layer" in scope and m.grouped_gemm == "loop",
            "full_layer cannot capture model.grouped_gemm=loop (it splits rows on the host); use torch or triton",
        ),
        (
            "moe_preprocess" in scope and model.moe.dispatcher in GATED_DISPATCHERS,
            f"moe_preprocess captures the torch permutation plan of the local and alltoall dispatchers; "
            f"model.dispatcher={model.moe.dispatcher} has none to capture (deepep's layout step runs on DeepEP's "
            "own stream, hybridep permutes inside its dispatch): leave moe_preprocess out",
        ),
        (
            "moe_preprocess" in scope and m.permute != "torch",
            "moe_preprocess captures the torch permutation plan; model.permute=triton builds its plan inside its "
            "kernels: use model.permute=torch or leave moe_preprocess out",
        ),
        (
            "full_layer" in scope
            and (model.moe.z_loss_coeff > 0 or model.moe.aux_loss == "sequence"),
            "full_layer carries the router's selections and probabilities out of the graph, not the z-loss "
            "or per-document sums of model.moe_z_loss_coeff / model.moe_aux_loss=sequence; use attn, "
            "moe_router, moe_preprocess",
        ),
        (
            bool({"moe_router", "moe_preprocess"} & set(scope)) and not model.moe.num_experts,
            "moe_router/moe_preprocess: this model has no MoE layers (model.num_experts=0); leave them out",
        ),
    ]
    _check(
        not any(bad for bad, _ in refusals),
        "\n".join(f"{key} {why}" for bad, why in refusals if bad),
    )


def _check_fp8(job, model: VLMConfig, dims: ParallelDims, environment: bool) -> None:
    """What model.fp8 cannot run with, then (with `environment`) whether its kernels run on this device."""
    f, m = model.fp8, job.model
    if f.recipe == "none":
        return
    key = f"model.fp8={f.recipe}"
    experts = "experts" in f.modules and model.moe.num_experts > 0
    refusals = [
        (
            bool(m.cuda_graph_scope),
            "with model.cuda_graph_scope: a graph would replay the weight codes of the step "
            "it was captured in; use model.cuda_graph_scope=[]",
        ),
        (
            bool(job.train.compile),
            "with train.compile=true is not supported yet (the FP8 autograd rule keeps "
            "per-step weight codes on the modules, which torch.compile would trace as constants); use "
            "train.compile=false",
        ),
        (
            experts
            and (f.pad_experts or f.backend == "torch")
            and dims.ep * dims.etp > 1
            and model.moe.dispatcher != "hybridep",
            "pads expert rows (model.fp8_pad_experts, or fp8_backend=torch) with the local and hybridep dispatchers "
            "only; with parallel.ep x etp > 1 use model.dispatcher=hybridep, or model.fp8_backend=triton without "
            "padding",
        ),
    ]
    _check(
        not any(bad for bad, _ in refusals),
        "\n".join(f"{key} {why}" for bad, why in refusals if bad),
    )
    if f.backend == "torch":
        t, moe = model.text, model.moe
        block = BLOCK[f.recipe]
        dims_ = {
            "text.hidden_size": t.hidden_size,
            "text.intermediate_size": t.intermediate_size,
            "moe.moe_intermediate_size": moe.moe_intermediate_size,
            "text.num_kv_heads*head_dim": t.num_kv_heads * t.head_dim,
        }
        bad = {k: v for k, v in dims_.items() if v % block}
        _check(
            not bad,
            f"{key} with model.fp8_backend=torch: cuBLAS's scaled GEMMs take whole {block}-blocks, but "
            f"{bad} are not multiples of {block}; use model.fp8_backend=triton or emulate",
        )
    if environment:
        from moevlm.model.fp8 import Fp8Unavailable, resolve_fp8

        cuda = torch.cuda.is_available() and job.train.device != "cpu"
        try:
            resolve_fp8(
                f,
                torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
            )
        except Fp8Unavailable as err:
            raise ConfigError(str(err)) from None


def _check_optimizer_offload(job, dims: ParallelDims) -> None:
    """What parallel.optimizer_offload needs of this torch (moevlm.parallel.optimizer_offload): FSDP2's CPU
    offload policy under FSDP over several processes, and a CPU kernel for an explicitly fused AdamW (the
    offloaded step runs on the host)."""
    if not job.parallel.optimizer_offload:
        return
    key = "parallel.optimizer_offload=true"
    if offload_kind(True, dims.world, job.parallel.dp_mode) == "fsdp":
        _check(
            fsdp_cpu_offload_available(),
            f"{key} under FSDP needs FSDP2's CPU offload policy (torch.distributed.fsdp.CPUOffloadPolicy), "
            "which this torch lacks; use parallel.dp_mode=ddp (a host AdamW) or parallel.optimizer_offload=false",
        )
    _check(
        job.optim.implementation != "fused" or cpu_fused_adamw(),
        f"{key} with optim.implementation=fused: this torch has no fused AdamW kernel for the CPU, where the "
        "offloaded step runs; use optim.implementation=auto (foreach there) or foreach",
    )


def fsdp_cpu_offload_available() -> bool:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_fused_adamw() -> bool:
    from moevlm.train.optim import _has_fused

    return _has_fused(torch.device("cpu"))


def _check_batch(t, dims: ParallelDims) -> None:
    _check(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _check(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    per_step = t.micro_batch_size * dims.dp
    _check(
        t.global_batch_size >= per_step and t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size x dp = "
        f"{t.micro_batch_size} x {dims.dp} = {per_step}; e.g. train.global_batch_size="
        f"{max(1, math.ceil(t.global_batch_size / per_step)) * per_step}",
    )
    _check(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _check(
        t.checkpoint_every >= 0,
        f"train.checkpoint_every={t.checkpoint_every} must be >= 0 (0 = at the end)",
    )
    _check(
        t.resume in ("auto", "none") or bool(t.resume),
        "train.resume must be auto, none or a checkpoint path",
    )
    _check(
        t.max_nonfinite_steps >= 1,
        f"train.max_nonfinite_steps={t.max_nonfinite_steps} must be >= 1",
    )
    _check(
        t.peak_tflops is None or _real(t.peak_tflops) and t.peak_tflops > 0,
        f"train.peak_tflops={t.peak_tflops!r} must be a finite number > 0 (TFLOP/s per device), or null for "
        "the device table",
    )


def _check_optim(o, steps: int) -> list[str]:
    """Every real-valued field must be a finite number in its range: Python's comparisons are False for
    NaN, so each range test is written to fail on it, and infinities are refused by name.  Returns notes
    (valid but probably unintended settings) for the log."""
    _check(_real(o.lr) and o.lr > 0, f"optim.lr={o.lr!r} must be a finite number > 0")
    _check(
        _real(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1,
        f"optim.min_lr_ratio={o.min_lr_ratio!r} must be a number in [0, 1] (final lr = lr x min_lr_ratio)",
    )
    betas = list(o.betas)
    _check(
        len(betas) == 2 and all(_real(b) and 0 <= b < 1 for b in betas),
        f"optim.betas={betas} must be two numbers in [0, 1), e.g. optim.betas=[0.9,0.95]",
    )
    _check(
        _real(o.eps) and o.eps > 0,
        f"optim.eps={o.eps!r} must be a finite number > 0 (AdamW divides by sqrt(v) + eps), e.g. optim.eps=1e-8",
    )
    _check(
        _real(o.weight_decay) and o.weight_decay >= 0,
        f"optim.weight_decay={o.weight_decay!r} must be a finite number >= 0 (0 = no decay)",
    )
    _check(
        _int(o.warmup_steps) and o.warmup_steps >= 0,
        f"optim.warmup_steps={o.warmup_steps!r} must be >= 0",
    )
    _check(
        _real(o.decay_fraction) and 0 < o.decay_fraction <= 1,
        f"optim.decay_fraction={o.decay_fraction!r} must be a number in (0, 1]",
    )
    _check(
        _real(o.grad_clip),
        f"optim.grad_clip={o.grad_clip!r} must be a finite number (the max gradient norm; 0 or less disables "
        "clipping)",
    )
    # the multiplier after warmup step s is (s + 1) / warmup: 1 at s = warmup - 1
    if o.warmup_steps > steps:
        return [
            f"note: optim.warmup_steps={o.warmup_steps} > train.steps={steps}: the learning rate never "
            f"reaches optim.lr={o.lr} in this run"
        ]
    return []


def _check_faults(p, t) -> None:
    _check(
        _real(p.timeout_s) and p.timeout_s > 0,
        f"parallel.timeout_s={p.timeout_s} must be > 0 seconds (torch's NCCL default is 600)",
    )
    _check(
        _real(t.watchdog_factor) and (t.watchdog_factor == 0 or t.watchdog_factor > 1),
        f"train.watchdog_factor={t.watchdog_factor} must be > 1 (x the median step time) or 0 (no reports)",
    )
    _check(
        _real(t.watchdog_min_s) and t.watchdog_min_s >= 0,
        f"train.watchdog_min_s={t.watchdog_min_s} must be >= 0",
    )
    _check(
        t.watchdog_abort_s is None or _real(t.watchdog_abort_s) and t.watchdog_abort_s > 0,
        f"train.watchdog_abort_s={t.watchdog_abort_s} must be > 0 seconds, or null (never abort)",
    )


def _check_validation(t, d) -> list[str]:
    """train.val_every / val_batches against data.val_shards; a note when held-out shards are named but
    never read."""
    _check(
        t.val_every >= 0,
        f"train.val_every={t.val_every} must be >= 0 (steps between validations; 0 = off)",
    )
    _check(
        t.val_batches >= 1,
        f"train.val_batches={t.val_batches} must be >= 1 (global batches of held-out rows per "
        "validation)",
    )
    _check(
        not t.val_every or bool(d.val_shards),
        f"train.val_every={t.val_every} validates on data.val_shards, which is not set: point "
        "data.val_shards at held-out shards (a folder, a brace pattern, a list, or sample), or set "
        "train.val_every=0",
    )
    if d.val_shards and not t.val_every:
        return [
            f"note: data.val_shards={d.val_shards} is set but train.val_every=0: no validation runs "
            "(set train.val_every=N to validate every N steps)"
        ]
    return []


def check_val_shards(spec: str) -> None:
    """data.val_shards as data.shards is checked, its messages naming data.val_shards."""
    try:
        check_shards(spec)
    except ValueError as err:
        raise ConfigError(str(err).replace("data.shards=", "data.val_shards=")) from None


def _check_profile(t) -> None:
    parse_profile_steps(t.profile_steps, t.steps)
    _check(
        not (t.profile_components and t.compile),
        "train.profile_components=true times modules with hooks, which would break the graphs of "
        "train.compile=true; profile eagerly (train.compile=false), or drop train.profile_components",
    )


CP_ATTN_BACKENDS = (
    "auto",
    "sdpa",
    "sdpa_per_doc",
)  # the decoder then runs cp_attention (SDPA blocks)


def _check_context_parallel(job, dims: ParallelDims) -> None:
    from moevlm.parallel.context_parallel import CP_COMMS

    p, m, t = job.parallel, job.model, job.train
    _check(p.cp_comm in CP_COMMS, f"parallel.cp_comm={p.cp_comm!r}; choose one of {list(CP_COMMS)}")
    if dims.cp == 1:
        return
    _check(
        m.attn_backend in CP_ATTN_BACKENDS,
        f"parallel.cp={dims.cp} computes the decoder's attention with its own allgather/ring function over SDPA "
        f"blocks; model.attn_backend={m.attn_backend} cannot run inside it: use model.attn_backend=auto or sdpa",
    )
    _check(
        not t.compile,
        f"parallel.cp={dims.cp} with train.compile=true is not supported yet (the cp attention's "
        "collectives are not traced); use train.compile=false",
    )
