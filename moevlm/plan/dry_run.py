"""One training step of a job at its real size, on fake tensors, for one rank of its layout.

    rank = dry_run(job, world=8, rank=0)        # RankPlan: bytes per category, collectives per group
    forward_on_fake_cuda(job)                   # the recipe's forward through its CUDA code paths

The model, optimizer and step are the trainer's (`moevlm.parallel.build_model`, `build_optimizer`,
the pipeline as the trainer starts it); only the values (`moevlm.plan.fake.PlanMode`) and the
process group (`fake`, any size) are fake.  The micro-batches fill every budget; routing is
balanced.  What the bytes mean, and offload in a plan: docs/architecture.md, "The planner".
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moevlm.data.batch import MicroBatch
from moevlm.data.encode import Sample
from moevlm.data.packing import collate
from moevlm.data.text import IGNORE_INDEX
from moevlm.model.rope import mrope_position_ids
from moevlm.parallel.optimizer_offload import offload_kind
from moevlm.plan.attribution import (
    ModuleStack,
    exact_split,
    merge_splits,
    offloaded_split,
    optimizer_split,
    saved_as_activations,
    summarize,
)
from moevlm.plan.attribution import local_shard as _local
from moevlm.plan.environments import emulated_autocast, fake_cuda, fake_world, symmetric_objects
from moevlm.plan.fake import CollectiveCounter, DryRunObservers, PlanMode, StorageTracker


@dataclass
class RankPlan:
    rank: int
    role: str
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_peak_bytes: int
    peak_bytes: int
    comm_bytes: dict = field(default_factory=dict)  # group role -> collective -> bytes per step
    seconds: float = 0.0
    # parallel.optimizer_offload (moevlm.parallel.optimizer_offload): "fsdp", "host" or None
    optimizer_offload: str | None = None
    offloaded_bytes: int = 0  # of params/grads/optimizer above, held in host memory instead
    optimizer_host_bytes: int = 0  # host memory the offload needs (this rank)
    h2d_bytes: int = 0  # host->device copies per step
    d2h_bytes: int = 0  # device->host copies per step
    # activation bytes copied to the host per step (model.offload_modules)
    activation_offload_bytes: int = 0
    activation_host_bytes: int = 0  # the most host memory those copies hold at once
    # the peak by kind, by module and its largest storages (moevlm.plan.attribution.summarize)
    attribution: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def budget_micro_batch(job, model_cfg, rows: int | None = None) -> MicroBatch:
    """A micro-batch of `train.micro_batch_size` rows that fill the pack budgets: one image of
    `pack.max_patches` and, where `pack.max_videos` > 0, one video of two temporal patches filling
    `pack.max_video_patches` in what the sequence leaves (docs/architecture.md)."""
    row = _budget_row(job.data.pack, model_cfg)
    return MicroBatch.from_rows([row] * (rows or job.train.micro_batch_size), model_cfg)


# The last budget row made, by everything it is made of: a fit or a search dry-runs one job at several
# depths and layouts, and the row (a real tensor of up to ~100 MB of random pixels) is the same for all
_LAST_ROW: dict = {}


def _budget_row(p, model_cfg):
    v = model_cfg.vision
    key = (
        repr(p),
        v.spatial_merge_size,
        v.patch_dim,
        model_cfg.image_token_id,
        model_cfg.video_token_id,
        model_cfg.vision_start_token_id,
    )
    if key not in _LAST_ROW:
        _LAST_ROW.clear()
        _LAST_ROW[key] = _make_budget_row(p, model_cfg)
    return _LAST_ROW[key]


def _make_budget_row(p, model_cfg):
    m = model_cfg.vision.spatial_merge_size
    S, Np = p.seq_len, p.max_patches
    side = int(min(Np, 4 * (S - 16)) ** 0.5) // m * m if Np else 0
    n_img = side * side // (m * m)
    Nv, room = (p.max_video_patches if p.max_videos else 0), S - 24 - n_img
    vside = int(min(Nv // 2, 2 * room) ** 0.5) // m * m if Nv and room > 0 else 0
    n_vid = 2 * vside * vside // (m * m)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (S,), generator=gen)
    labels = ids.clone()
    grids, vgrids, pixels, vpixels = [], [], None, None
    for n, token, at in (
        (n_img, model_cfg.image_token_id, 8),
        (n_vid, model_cfg.video_token_id, 12 + n_img),
    ):
        if n:
            ids[at] = model_cfg.vision_start_token_id
            ids[at + 1 : at + 1 + n] = token
            labels[at : at + 1 + n] = IGNORE_INDEX
    if n_img:
        grids = [(1, side, side)]
        pixels = torch.randn(side * side, model_cfg.vision.patch_dim, generator=gen)
    if n_vid:
        vgrids = [(2, vside, vside)]
        vpixels = torch.randn(2 * vside * vside, model_cfg.vision.patch_dim, generator=gen)
    grid_t = torch.tensor(grids, dtype=torch.long) if grids else None
    vgrid_t = torch.tensor(vgrids, dtype=torch.long) if vgrids else None
    pos = mrope_position_ids(
        ids[None], grid_t, model_cfg.image_token_id, m, None, vgrid_t, model_cfg.video_token_id
    )[:, 0]
    sample = Sample("budget", None, ids, labels, pos, pixels, grids, [], vpixels, vgrids)
    return collate([sample], p, model_cfg.vision.patch_dim, pad_id=0)


def _build(job, plan, device_type: str, bf16: bool):
    """The trainer's model build for this rank (moevlm.train.setup.build), for `device_type` and
    `bf16`; without compile, FP8, CUDA graphs and optimizer offload, which the plan does not model."""
    import dataclasses

    from moevlm.parallel.build import build_model

    options = dataclasses.replace(
        plan.build,
        device_type=device_type,
        bf16=bf16,
        compile=False,
        compile_mode=None,
        fp8=None,
        fp8_modules=(),
        cuda_graph_scope=(),
        optimizer_offload=False,
        dispatcher=plan.build.dispatcher.for_plan(),  # deepep / hybridep modelled, never imported
        gdn_backend="modelled" if bf16 else "auto",  # fla's kernel, as a bf16 GPU run takes it
    )
    return build_model(plan.model, plan.dims, options)


def _roles(ctx) -> dict[str, str]:
    """Process group name -> the roles it serves (`tp`, `ep`, `dense`...), joined when it serves several."""
    names: dict[str, list[str]] = {}
    for role, group in ctx.groups.items():
        if group is not None:
            names.setdefault(group.group_name, []).append(role)
    # the default group, where no role's group is it (the step's few scalar reductions)
    if dist.is_initialized():
        names.setdefault(dist.group.WORLD.group_name, ["world"])
    return {name: "/".join(roles) for name, roles in names.items()}


def rank_role(plan, rank: int) -> str:
    dims = plan.dims
    if dims.pp == 1:
        return "every rank"
    stage = dims.coords(rank)["pp"]
    return "first stage" if stage == 0 else "last stage" if stage == dims.pp - 1 else "middle stage"


def dry_run(
    job,
    world: int | None = None,
    rank: int = 0,
    bf16: bool | None = None,
    every_micro_batch=False,
    watch=None,
) -> RankPlan:
    """One training step of `job` for `rank` of a `world`-rank launch, on fake CPU tensors.

    The step's micro-batches repeat each other, so not all are run (`every_micro_batch` runs them
    all): without pipeline stages two run, and the collectives of the micro-batch phase are scaled to
    the step's count (the second micro-batch already finds the gradients allocated: the steady
    state).  A pipeline schedule runs twice, with 2 pp x vpp and 2 pp x vpp + pp micro-batches (both
    past the warm-up): every collective's bytes are then a + b x M exactly, and the peak to within
    bytes (it grows by what the schedule keeps per micro-batch), a from the step's once-only work (FSDP's
    gathers and reductions, the loss) and b per micro-batch, M the step's count.  `watch`: a dispatch
    mode entered above the fake one for the step (`moevlm.plan.syncs.SyncCounter`)."""
    from moevlm.config import validate

    world = world or job.parallel.world_size or 1
    plan = validate(job, world, environment=False)
    if bf16 is None:
        bf16 = _bf16(job)
    t0 = time.perf_counter()
    M, p = plan.grad_accum, plan.pipeline
    if p is None:
        run = M if every_micro_batch else min(M, 2)
        sizes, peak, comm, host, split = _step(job, plan, world, rank, bf16, run, watch=watch)
        comm_bytes = comm.as_dict({"micro-batches": M / run})
        # the host copies are made per micro-batch and freed by its backward
        offload = round(host.host_total_bytes * M / run), host.host_peak_bytes
    else:
        m1, m2 = short_steps(p)
        if every_micro_batch or M <= m2:
            sizes, peak, comm, host, split = _step(job, plan, world, rank, bf16, M, watch=watch)
            comm_bytes = comm.as_dict()
            offload = host.host_total_bytes, host.host_peak_bytes
        else:
            runs = [
                _step(job, _cut(plan, m), world, rank, bf16, m, step_micro_batches=M, watch=watch)
                for m in (m1, m2)
            ]
            (_, peak1, c1, h1, s1), (sizes, peak2, c2, h2, s2) = runs

            def at_m(a: float, b: float) -> int:
                """The value at M of the line through (m1, a) and (m2, b)."""
                return round(a + (b - a) * (M - m1) / (m2 - m1))

            # past the warm-up the peak still grows by what the schedule keeps per micro-batch
            # (torch's receive buffers and the losses of each): linear in M too, as the host copies
            peak = at_m(peak1, peak2)
            # in the runs' order (a set's order would follow string hashes: the attribution's ties
            # listed differently from one process to the next)
            labels = dict.fromkeys([*s1, *s2])
            split = {k: at_m(s1.get(k, 0), s2.get(k, 0)) for k in labels}
            offload = (
                at_m(h1.host_total_bytes, h2.host_total_bytes),
                at_m(h1.host_peak_bytes, h2.host_peak_bytes),
            )
            comm_bytes = _extrapolate(c1.as_dict(), c2.as_dict(), m1, m2, M)
    trainable = sizes.pop("trainable_bytes")
    kind = ctx_offload(job, plan)
    moved = {} if kind is None else offload_figures(kind, sizes, trainable, M, p is not None)
    return RankPlan(
        rank=rank,
        role=rank_role(plan, rank),
        **sizes,
        optimizer_offload=kind,
        **moved,
        activation_peak_bytes=peak - sum(sizes.values()) + moved.get("offloaded_bytes", 0),
        peak_bytes=peak,
        comm_bytes=comm_bytes,
        seconds=time.perf_counter() - t0,
        activation_offload_bytes=offload[0],
        activation_host_bytes=offload[1],
        attribution=summarize(exact_split(split, peak)),
    )


@contextlib.contextmanager
def _one_thread():
    """The host values a plan computes are small: one thread (a parallel kernel's threads waiting on
    a busy core cost far more than they save)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_micro_batches(job, plan, world: int, micro_batches: int, watch) -> None:
    """`micro_batches` of rank 0's training step (`plan` = validate(job, world)) on fake tensors under
    the dispatch mode `watch`, as the dry run's short steps run them: a pipeline's schedule cut to
    them, the loss normalized as the whole step's (`moevlm.plan.cli.step_syncs`)."""
    M = plan.grad_accum
    _step(job, _cut(plan, micro_batches), world, 0, _bf16(job), micro_batches, M, watch=watch)


def _cut(plan, micro_batches: int):
    """`plan` with its pipeline schedule cut to `micro_batches` (without stages: `plan` itself, whose
    step simply runs fewer)."""
    import dataclasses

    if plan.pipeline is None:
        return plan
    pipeline = dataclasses.replace(plan.pipeline, microbatches=micro_batches)
    build = dataclasses.replace(plan.build, pipeline=pipeline)
    return dataclasses.replace(plan, build=build, grad_accum=micro_batches)


def _bf16(job) -> bool:
    return job.train.precision in ("bf16", "auto")


def short_steps(pipeline) -> tuple[int, int]:
    """The micro-batches of a pipeline's two short steps: 2 pp x vpp and that + pp, both past the
    warm-up (pp x vpp deep) on every stage."""
    m1 = 2 * pipeline.pp * pipeline.vpp
    return m1, m1 + pipeline.pp


def _extrapolate(c1: dict, c2: dict, m1: int, m2: int, m: int) -> dict:
    """Bytes a + b x M from the counts at m1 and m2 micro-batches, per group and collective."""
    out: dict = {}
    for group in sorted(set(c1) | set(c2)):
        kinds = {}
        for kind in sorted(set(c1.get(group, {})) | set(c2.get(group, {}))):
            b1, b2 = c1.get(group, {}).get(kind, 0), c2.get(group, {}).get(kind, 0)
            kinds[kind] = round(b1 + (b2 - b1) * (m - m1) / (m2 - m1))
        out[group] = kinds
    return out


def _step(
    job,
    plan,
    world: int,
    rank: int,
    bf16: bool,
    run: int,
    step_micro_batches: int | None = None,
    watch=None,
):
    """`run` micro-batches of the trainer's step on fake tensors: (bytes of parameters, gradients and
    optimizer state; the steady-state peak; the CollectiveCounter; the StorageTracker, whose host_*
    fields count the activation offload's host copies).  `step_micro_batches`: the step's
    real count, for the loss normalization (default `plan.grad_accum`)."""
    from moevlm.model.objective import objective
    from moevlm.parallel.build import materialize_
    from moevlm.train.optim import build_optimizer
    from moevlm.train.setup import boundary_dtypes
    from moevlm.train.trainer import sum_over

    device = torch.device("cpu")
    dtype = torch.bfloat16 if bf16 else None
    with fake_world(world, rank), symmetric_objects(), _one_thread():
        model, ctx = _build(job, plan, device.type, bf16)
        where = ModuleStack(model)
        mem, comm = StorageTracker(where), CollectiveCounter(_roles(ctx))
        labels = mem.attribution
        real = budget_micro_batch(job, plan.model)  # real tensors: built before the fake mode
        watching = watch if watch is not None else contextlib.nullcontext()
        with PlanMode() as mode, watching, DryRunObservers(mem, comm):
            materialize_(model, device, ctx)
            params = [p for p in model.parameters()]
            mem.track(params)
            labels.label_params(model)
            labels.phase = "step"
            opt = build_optimizer(model, job.optim)
            # state made with the optimizer (optim.master_weights' fp32 masters) is live from here on:
            # the forward/backward peak holds it already
            at_build = {k: -b for k, b in optimizer_split(opt, model).items()}
            pipe = ctx.pipeline
            if pipe is not None:
                d = job.data.pack
                pipe.start(
                    device,
                    rows=job.train.micro_batch_size,
                    seq_len=d.seq_len,
                    max_patches=d.max_patches,
                    max_video_patches=d.max_video_patches if d.max_videos else 0,
                    seq_shards=plan.dims.tp * plan.dims.cp,
                    autocast=lambda: emulated_autocast(device.type, dtype),
                    **boundary_dtypes(bf16, job.parallel.dp_mode),
                )
                _decide_static_vote(pipe.schedule)
            M = step_micro_batches or plan.grad_accum
            micro = []
            for _ in range(run):
                fields = {k: _placed(mode, k, v, device) for k, v in real.model_inputs().items()}
                micro.append(MicroBatch(**fields, **{k: getattr(real, k) for k in _COUNTS}))
            loss_tokens = float(real.loss_tokens * M * plan.dims.dp)
            share = M * plan.dims.dp
            # the trainer's token-count all-reduce (its values are read on the host there, not here):
            # loss tokens, useful tokens, FLOPs, images, image tokens, vision FLOPs, videos, video
            # tokens, and one vision FLOPs slot per data-parallel rank and micro-batch
            # (vision_flops_max_over_mean)
            if ctx.dp_group is not None:
                dist.all_reduce(
                    torch.zeros(8 + plan.dims.dp * M, dtype=torch.float64, device=device),
                    group=ctx.dp_group,
                )
            comm.phase = "micro-batches"
            loss_sum = aux_sum = torch.zeros((), device=device)
            grad_hooks = [
                p.register_post_accumulate_grad_hook(labels.grad_hook(name))
                for name, p in model.named_parameters()
                if p.requires_grad
            ]
            with where, saved_as_activations(mem):
                if pipe is not None:
                    lm, aux, _ = pipe.forward_backward(micro, loss_tokens, share)
                    sums = sum_over(torch.stack([lm, aux]), ctx.pp_group)
                    loss_sum, aux_sum = sums[0], sums[1]
                for mb in micro if pipe is None else ():
                    with emulated_autocast(device.type, dtype):
                        out = model(**mb.forward_kwargs())
                    lm_sum = out.lm_loss * out.num_loss_tokens
                    objective(
                        lm_sum,
                        loss_tokens,
                        out.aux_loss,
                        plan.model.moe.router_aux_loss_coef,
                        share,
                    ).backward()
                    loss_sum = loss_sum + lm_sum.detach()
                    if out.aux_loss is not None:
                        aux_sum = aux_sum + out.aux_loss.detach() / share
                    del out, lm_sum
                    labels.label_grads(model)
            for h in grad_hooks:
                h.remove()
            comm.phase = "step"
            ctx.finish_gradients()
            labels.label_grads(model)
            grads = [p for p in model.parameters() if p.grad is not None]
            clip = job.optim.grad_clip if job.optim.grad_clip > 0 else float("inf")
            ctx.clip_grad_norm_(grads, clip)
            sum_over(loss_sum, ctx.loss_group)  # the trainer's loss and aux reductions
            sum_over(aux_sum, ctx.dp_group)
            fwd_bwd_peak, fwd_bwd_split = mem.peak_bytes, mem.split_at_peak()
            mem.reset_peak()
            labels.phase = "optimizer"
            opt.step()  # the first step makes the state: in later steps it lives through all of this
            state = [
                t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            ]
            sizes = {
                "params_bytes": _bytes(params),
                "grads_bytes": _bytes([p.grad for p in grads]),
                "optimizer_bytes": _bytes(state),
            }
            trainable = _bytes([p for p in params if p.requires_grad])
            kind = ctx_offload(job, plan)
            state_split = optimizer_split(opt, model)
            if kind is None:
                steady = fwd_bwd_peak + sizes["optimizer_bytes"] + sum(at_build.values())
                peak = max(steady, mem.peak_bytes)
                split = (
                    merge_splits(fwd_bwd_split, state_split, at_build)
                    if peak == steady
                    else mem.split_at_peak()
                )
            else:
                # the steady state's forward/backward (the state alive) less what lives on the host;
                # the step itself runs on the host
                moved = offload_figures(kind, sizes, trainable, 1, False)
                peak = fwd_bwd_peak + sizes["optimizer_bytes"] - moved["offloaded_bytes"]
                split = merge_splits(fwd_bwd_split, offloaded_split(kind, sizes))
    return {**sizes, "trainable_bytes": trainable}, peak, comm, mem, split


def ctx_offload(job, plan) -> str | None:
    """parallel.optimizer_offload's mechanism for this layout (moevlm.parallel.build)."""
    return offload_kind(job.parallel.optimizer_offload, plan.dims.world, job.parallel.dp_mode)


def offload_figures(
    kind: str, sizes: dict, trainable: int, micro_batches: int, pipeline: bool
) -> dict:
    """Bytes of one rank under optimizer offload `kind` (docs/architecture.md): taken off the
    device, needed on the host, copied host->device and device->host per step."""
    p, g, o = sizes["params_bytes"], sizes["grads_bytes"], sizes["optimizer_bytes"]
    if kind == "host":  # masters, gradient buffers, AdamW state
        return dict(
            offloaded_bytes=o,
            optimizer_host_bytes=2 * trainable + o,
            h2d_bytes=trainable,
            d2h_bytes=g,
        )
    gathers = 1 if pipeline else 2 * micro_batches
    return dict(
        offloaded_bytes=p + g + o,
        optimizer_host_bytes=p + g + o,
        h2d_bytes=gathers * p,
        d2h_bytes=micro_batches * g,
    )


def _decide_static_vote(schedule) -> None:
    """torch's pipeline schedules (2.13) vote over point-to-point messages, at their first step,
    whether every stage's boundary shapes are static; a fake process group delivers nothing, so the
    vote is decided from this rank's stages, which the same code builds on every rank."""
    if not hasattr(schedule, "_warmup_p2p"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages, has_backward, p2p_done):
        for s in stages:
            dynamic = InferenceMode.needs_dynamic(s._user_meta, has_backward)
            s._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedule._warmup_p2p = vote


_COUNTS = (
    "loss_tokens",
    "useful_tokens",
    "flops",
    "n_image",
    "images",
    "vision_flops_cp",
    "n_video",
    "videos",
)


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _placed(mode, name: str, value, device):
    """A model input where the trainer's `MicroBatch.to` puts it: fake on the step's device, or the
    loader's real tensor where it stays on the host (`MicroBatch.HOST_INPUTS`)."""
    if value is None or name in MicroBatch.HOST_INPUTS or not torch.is_tensor(value):
        return value
    return mode.fake(value, device)


def forward_on_fake_cuda(job, watch=None, captured: bool = False) -> dict:
    """The forward of one full-budget micro-batch on fake CUDA, one process (world 1 recipes), in the
    trainer's GPU precision: the CUDA code paths at the real size, without memory.  `attn_backend=auto`
    runs sdpa: for bf16 weights (optim.master_weights) without flash-attn it resolves to compiled flex,
    which Inductor cannot build for fake CUDA on a CPU-only torch.  `watch`: a dispatch mode entered
    above the fake one for the forward (`moevlm.plan.syncs.SyncCounter`).  `captured`: the inputs as a
    captured step passes them (moevlm.train.step_graph: every tensor on the device, the images or
    videos laid out, checked on the host, static masks)."""
    import copy

    from moevlm.config import validate
    from moevlm.parallel.build import materialize_
    from moevlm.parallel.compile import use_static_masks
    from moevlm.train.step_graph import host_inputs

    if job.model.attn_backend == "auto":
        job = copy.deepcopy(job)
        job.model.attn_backend = "sdpa"
    plan = validate(job, 1, environment=False)
    bf16 = _bf16(job)
    cuda = torch.device("cuda", 0)
    t0 = time.perf_counter()
    model, ctx = _build(job, plan, "cuda", bf16)
    real = budget_micro_batch(job, plan.model)
    # a captured step's inputs as it fills its buffers on the host (`host_inputs`), then on the device
    # as `captured_inputs` puts them: cu_seqlens and the images' (videos') layout included
    kwargs = host_inputs(real, plan.model) if captured else real.forward_kwargs()
    with fake_cuda(), PlanMode() as mode, torch.no_grad():
        materialize_(model, cuda, ctx)
        inputs = {k: _placed(mode, k, v, cuda) for k, v in kwargs.items()}
        if captured:
            use_static_masks(model)
            inputs["cu_seqlens"] = mode.fake(real.cu_seqlens, cuda)
            if "vision_layout" in kwargs:
                inputs["vision_layout"] = kwargs["vision_layout"].map(lambda t: mode.fake(t, cuda))
        watching = watch if watch is not None else contextlib.nullcontext()
        with watching, emulated_autocast("cuda", torch.bfloat16 if bf16 else None):
            out = model(**inputs)
        found = {"loss_dtype": out.lm_loss.dtype, "loss_device": out.lm_loss.device}
    found["seconds"] = time.perf_counter() - t0
    return found
