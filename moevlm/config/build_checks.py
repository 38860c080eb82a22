"""Checks of the build options against each other and the layout: recompute, activation and
optimizer offload, lighter model state, CUDA graphs, FP8, context parallel, the EP overlap; each
raises ConfigError with every refusal of its option, one line each."""

from __future__ import annotations

import torch

from moevlm.config.dispatcher import GATED
from moevlm.config.environment import graph_scope
from moevlm.dispatch import DISPATCHERS, DispatcherSpec
from moevlm.errors import ConfigError, check
from moevlm.model.config import VLMConfig
from moevlm.model.fp8 import BLOCK, Fp8Recipe, Fp8Unavailable, resolve_fp8
from moevlm.parallel.cuda_graphs import scope_problem
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.offload import GRAPH_OVERLAPS
from moevlm.parallel.offload import check as offload_problem
from moevlm.parallel.optimizer_offload import fused_adamw_available, offload_kind
from moevlm.parallel.recompute import check as recompute_problem
from moevlm.parallel.recompute import recompute_setting


def check_recompute(m) -> None:
    reason = recompute_problem(
        m.recompute, tuple(m.recompute_modules or ()), m.recompute_collectives
    )
    if reason is not None:
        raise ConfigError(reason)


def check_offload(job) -> None:
    """model.offload_modules: known scopes, not inside recomputed regions, nothing it cannot run with."""
    m = job.model
    modules = tuple(m.offload_modules or ())
    if not modules:
        return
    reason = offload_problem(modules, recompute_setting(m))
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
    refuse(key, refusals)


def check_ep_overlap(job, model: VLMConfig, dims: ParallelDims, spec: DispatcherSpec) -> None:
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
            not DISPATCHERS[spec.name].overlappable,
            f"runs the alltoall dispatcher only, not {spec.name!r}; set "
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
    refuse("parallel.ep_overlap=true", refusals)


def check_cuda_graphs(job, model: VLMConfig, dims: ParallelDims, spec: DispatcherSpec) -> None:
    """What `model.cuda_graph_scope` cannot capture safely (moevlm.parallel.cuda_graphs), each with its reason."""
    m, scope = job.model, [str(s) for s in job.model.cuda_graph_scope]
    if not scope:
        return
    key = f"model.cuda_graph_scope={graph_scope(m)}"
    problem = scope_problem(scope)
    check(problem is None, f"{problem}")
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
            "moe_preprocess" in scope and spec.name in GATED,
            f"moe_preprocess captures the torch permutation plan of the local and alltoall dispatchers; "
            f"model.dispatcher={spec.name} has none to capture (deepep's layout step runs on DeepEP's "
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
    refuse(key, refusals)


def check_step_graph(job, model: VLMConfig, dims: ParallelDims) -> None:
    """What `train.cuda_graph=step` cannot capture (moevlm.train.step_graph), each with its reason."""
    t, m, d = job.train, job.model, job.data
    if t.cuda_graph == "off":
        return
    check(
        t.cuda_graph_warmup >= 1,
        "train.cuda_graph_warmup must be >= 1 (eager steps before capture)",
    )
    refusals = [
        (
            d.pack.max_patches > 0 and d.pack.max_videos > 0,
            "captures text rows with images or with videos, not both (data.pack.max_videos=0, or "
            "data.pack.max_patches=0): a micro-batch's images (videos) are laid out on the host into "
            "fixed-size buffers, but a row mixing them orders the tower's patches by counts the host "
            "would read each step",
        ),
        (
            dims.pp > 1,
            "cannot capture a pipeline schedule (parallel.pp>1): its stages exchange micro-batches by "
            "point-to-point sends the host orders; use parallel.pp=1",
        ),
        (
            dims.tp * dims.cp > 1,
            "reads the documents' bounds on the host to split the sequence (context parallel) and is not "
            "built for tensor parallel yet; use parallel.tp=1 and parallel.cp=1",
        ),
        (
            dims.ep * dims.etp > 1,
            "cannot capture the expert all-to-all: the dropless one exchanges its split sizes through the "
            "host, the capacity one keeps its dropped-row counters between steps on the host; use "
            "parallel.ep=1 (the local dispatcher)",
        ),
        (
            any(kind == "linear_attention" for kind in model.text.layer_types),
            "cannot capture Gated DeltaNet layers (their kernels read the documents' lengths on the "
            "host); use train.cuda_graph=off",
        ),
        (
            bool(m.cuda_graph_scope),
            "already holds every region model.cuda_graph_scope would capture; use model.cuda_graph_scope=[]",
        ),
        (
            bool(m.offload_modules) or job.parallel.optimizer_offload,
            "cannot capture the host copies of model.offload_modules or parallel.optimizer_offload; "
            "leave them off",
        ),
        (
            job.optim.master_weights or job.optim.state_dtype != "float32",
            "steps torch's capturable AdamW (fp32 state, the parameters' own dtype); "
            "optim.master_weights and optim.state_dtype=bfloat16 use moevlm's AdamW, not captured",
        ),
        (
            model.fp8.recipe != "none",
            "with model.fp8: a replay would reuse the weight codes of the step it was captured in; "
            "use model.fp8=none",
        ),
        (
            bool(t.profile_components),
            "and train.profile_components=true: the components' timers run on the host, which a replay "
            "skips; profile with train.cuda_graph=off",
        ),
    ]
    refuse("train.cuda_graph=step", refusals)


def check_fp8(
    job, model: VLMConfig, dims: ParallelDims, spec: DispatcherSpec, environment: bool
) -> Fp8Recipe | None:
    """What model.fp8 cannot run with, then (with `environment`) whether its kernels run on this device."""
    f, m = model.fp8, job.model
    if f.recipe == "none":
        return None
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
            and not DISPATCHERS[spec.name].pads_experts,
            "pads expert rows (model.fp8_pad_experts, or fp8_backend=torch) with the local and hybridep dispatchers "
            "only; with parallel.ep x etp > 1 use model.dispatcher=hybridep, or model.fp8_backend=triton without "
            "padding",
        ),
    ]
    refuse(key, refusals)
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
        check(
            not bad,
            f"{key} with model.fp8_backend=torch: cuBLAS's scaled GEMMs take whole {block}-blocks, but "
            f"{bad} are not multiples of {block}; use model.fp8_backend=triton or emulate",
        )
    if not environment:
        return None
    cuda = torch.cuda.is_available() and job.train.device != "cpu"
    try:
        return resolve_fp8(
            f, torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
    except Fp8Unavailable as err:
        raise ConfigError(str(err)) from None


def check_optimizer_offload(job, dims: ParallelDims) -> None:
    """What parallel.optimizer_offload needs of this torch (moevlm.parallel.optimizer_offload): FSDP2's CPU
    offload policy under FSDP over several processes, and a CPU kernel for an explicitly fused AdamW (the
    offloaded step runs on the host)."""
    if not job.parallel.optimizer_offload:
        return
    key = "parallel.optimizer_offload=true"
    if offload_kind(True, dims.world, job.parallel.dp_mode) == "fsdp":
        check(
            fsdp_cpu_offload_available(),
            f"{key} under FSDP needs FSDP2's CPU offload policy (torch.distributed.fsdp.CPUOffloadPolicy), "
            "which this torch lacks; use parallel.dp_mode=ddp (a host AdamW) or parallel.optimizer_offload=false",
        )
    check(
        job.optim.implementation != "fused" or cpu_fused_adamw(),
        f"{key} with optim.implementation=fused: this torch has no fused AdamW kernel for the CPU, where the "
        "offloaded step runs; use optim.implementation=auto (foreach there) or foreach",
    )


def check_light_state(job, dims: ParallelDims, cuda: bool) -> None:
    """optim.state_dtype and optim.master_weights against the rest (moevlm.train.adamw,
    moevlm.parallel.master_weights): bf16 weights need bf16 compute; what they are not built with."""
    o, t, p = job.optim, job.train, job.parallel
    check(
        o.state_dtype == "float32" or o.implementation != "fused",
        f"optim.state_dtype={o.state_dtype} with optim.implementation=fused: torch's fused AdamW keeps the "
        "moments in the weights' dtype; use optim.implementation=auto (moevlm's AdamW then) or "
        "optim.state_dtype=float32",
    )
    if not o.master_weights:
        return
    bf16 = t.precision == "bf16" or (t.precision == "auto" and (cuda or t.device == "cuda"))
    refuse(
        "optim.master_weights=true",
        [
            (
                not bf16,
                f"makes the model's weights bf16, which needs bf16 compute, but train.precision={t.precision} "
                f"computes in fp32 here; set train.precision=bf16 (or auto on CUDA) or "
                "optim.master_weights=false",
            ),
            (
                o.implementation == "fused",
                "with optim.implementation=fused: the masters' AdamW is moevlm's (it reads the bf16 "
                "gradients); use optim.implementation=auto",
            ),
            (
                bool(p.optimizer_offload),
                "with parallel.optimizer_offload=true is not built (the offload keeps fp32 masters of its "
                "own); use one of the two",
            ),
            (
                dims.pp > 1,
                f"with parallel.pp={dims.pp} is not built yet (the stage boundaries' dtypes follow fp32 "
                "weights); use optim.master_weights=false with pipeline stages",
            ),
        ],
    )


def fsdp_cpu_offload_available() -> bool:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_fused_adamw() -> bool:
    return fused_adamw_available(torch.device("cpu"))


CP_ATTN_BACKENDS = (
    "auto",
    "sdpa",
    "sdpa_per_doc",
)  # the decoder then runs cp_attention (SDPA blocks)


def check_context_parallel(job, dims: ParallelDims) -> None:
    m, t = job.model, job.train
    if dims.cp == 1:
        return
    check(
        m.attn_backend in CP_ATTN_BACKENDS,
        f"parallel.cp={dims.cp} computes the decoder's attention with its own allgather/ring function over SDPA "
        f"blocks; model.attn_backend={m.attn_backend} cannot run inside it: use model.attn_backend=auto or sdpa",
    )
    check(
        not t.compile,
        f"parallel.cp={dims.cp} with train.compile=true is not supported yet (the cp attention's "
        "collectives are not traced); use train.compile=false",
    )


def check_lora(job, dims: ParallelDims) -> None:
    """model.lora_rank > 0: every layout trains adapters (moevlm.parallel shards them with their base
    weights); what is not built yet is refused by name."""
    m, t = job.model, job.train
    check(
        not t.export_adapter or m.lora_rank,
        f"train.export_adapter={t.export_adapter} needs adapters: set model.lora_rank > 0",
    )
    if not m.lora_rank:
        return
    refusals = [
        (
            m.freeze_vision and "vision" in m.lora_modules,
            "with model.freeze_vision=true and vision in model.lora_modules: a frozen tower trains no "
            "adapters; drop one of the two",
        ),
    ]
    refuse(f"model.lora_rank={m.lora_rank}", refusals)


def refuse(key: str, refusals: list[tuple[bool, str]]) -> None:
    """ConfigError with a line `key why` for each (applies, why) refusal that applies."""
    check(
        not any(bad for bad, _ in refusals),
        "\n".join(f"{key} {why}" for bad, why in refusals if bad),
    )
