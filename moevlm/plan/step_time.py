"""The step time model of the layout search: compute, recompute and the pipeline bubble over the
GPU's bf16 peak, every collective's wire bytes over its link's bandwidth, exposed or overlapped.

    timer = StepTimeModel(job, world, gpu("h100"))
    timer.busy(layout, plan)               # compute_s, recompute_s, bubble, busy_s: no dry run
    timer.step(layout, plan, comm_bytes)   # + exposed/overlapped comm, step_s, tokens_per_s, mfu
    wire_bytes("all_gather", payload, n)   # bytes one GPU sends for a collective on n ranks

    step_s = max(busy_s, overlapped_comm_s) + exposed_comm_s
    busy_s = (compute_s + recompute_s) / (1 - bubble)
The model's terms and why: docs/architecture.md, "The planner".
"""

from __future__ import annotations

import copy

from moevlm.plan.candidates import Layout
from moevlm.plan.devices import Gpu
from moevlm.plan.dry_run import budget_micro_batch

EXPOSED_ROLES = frozenset({"tp", "cp", "etp", "cp_tp", "pp"})
EXPOSED_KINDS = frozenset({"all_to_all", "send"})


def _role_ranks(role: str, dims) -> list[int]:
    """Rank 0's group of `role` (ParallelContext.groups' names); None when the role is unknown."""
    g = dims.groups(0)
    per_stage = dims.world // dims.pp
    return {
        "tp": g["tp"],
        "cp": g["cp"],
        "dp": g["dp"],
        "pp": g["pp"],
        "ep": g["ep"],
        "etp": g["etp"],
        "expert": g["edp"],
        "dense": g["dp_cp"],
        "vision": list(range(per_stage)),
        **{name: g[name] for pair in dims.FOLDED.values() for name in pair},
        "cp_tp": list(range(dims.cp * dims.tp)),
    }.get(role)


def group_ranks(group: str, dims) -> list[int]:
    """Rank 0's group of a collective's group name (roles joined by "/" name one set of ranks; the
    first known role gives it); an unknown name is taken as the whole world."""
    for role in group.split("/"):
        ranks = _role_ranks(role, dims)
        if ranks:
            return ranks
    return list(range(dims.world))


def link_gbps(group: str, dims, g: Gpu) -> float:
    """NVLink bandwidth when rank 0's group lies in one NVLink domain (domains are consecutive
    blocks of ranks), else the network's."""
    return g.nvlink_gbps if max(group_ranks(group, dims)) // g.domain == 0 else g.network_gbps


def wire_bytes(kind: str, payload: float, n: int) -> float:
    """Bytes one GPU sends for a collective of `kind` into which it put `payload` bytes, on a group
    of `n` ranks, as a ring algorithm moves them (docs/architecture.md)."""
    if n <= 1 and kind not in ("send", "recv"):
        return 0.0
    return {
        "all_gather": payload * (n - 1),
        "reduce_scatter": payload * (n - 1) / n,
        "all_to_all": payload * (n - 1) / n,
        "all_reduce": payload * 2 * (n - 1) / n,
        "recv": 0.0,
    }.get(kind, payload)


def is_exposed(group: str, kind: str) -> bool:
    """All-to-alls and sends are on the critical path, as is every collective of a group that
    serves tp, cp, etp, cp_tp or pp; FSDP/DDP traffic (dp, dense, expert, vision) overlaps."""
    return kind in EXPOSED_KINDS or bool(EXPOSED_ROLES & set(group.split("/")))


def comm_seconds(comm_bytes: dict, dims, g: Gpu) -> tuple[float, float]:
    """(exposed, overlapped) seconds of a step's collectives: wire bytes over the link's bandwidth."""
    exposed = overlapped = 0.0
    for group, kinds in comm_bytes.items():
        bw, n = link_gbps(group, dims, g) * 1e9, len(group_ranks(group, dims))
        for kind, nbytes in kinds.items():
            seconds = wire_bytes(kind, nbytes, n) / bw
            if is_exposed(group, kind):
                exposed += seconds
            else:
                overlapped += seconds
    return exposed, overlapped


def recompute_forward_flops(cfg, mb, mode: str, modules=()) -> float:
    """Forward FLOPs one micro-batch recomputes in backward, counted as moevlm.model.flops counts
    (matmuls and attention's QK^T and PV; norms and activations are free)."""
    from moevlm.model.flops import doc_lens_of, layer_forward_parts, vision_block_forward_parts

    if mode == "none":
        return 0.0
    B, S = mb.input_ids.shape
    docs = doc_lens_of(B, S, mb.cu_seqlens)
    grids = [] if mb.image_grid_thw is None else mb.image_grid_thw.tolist()
    depth = cfg.vision.depth
    layers = [layer_forward_parts(cfg, i, docs) for i in range(cfg.text.num_layers)]
    block = vision_block_forward_parts(cfg, grids)
    vision_block = sum(block.values())
    if mode == "full":
        return float(sum(sum(p.values()) for p in layers) + depth * vision_block)
    regions = {
        "core_attn": sum(p["core_attn"] for p in layers) + depth * block["core_attn"],
        "mlp": sum(p.get("mlp", 0) for p in layers) + depth * block["mlp"],
        "moe": sum(p.get("moe", 0) for p in layers),
        "vision": depth * vision_block,
    }
    chosen = set(modules)
    if "vision" in chosen:  # regions inside a recomputed vision block are not recomputed twice
        regions["core_attn"] -= depth * block["core_attn"]
        regions["mlp"] -= depth * block["mlp"]
    return float(sum(regions.get(r, 0) for r in chosen))


class StepTimeModel:
    """The step time model (docs/architecture.md) for one job, world and GPU."""

    def __init__(self, job, world: int, g: Gpu):
        self.job, self.world, self.g = job, world, g
        self.modules = tuple(job.model.recompute_modules or ())
        self._flops: dict = {}

    def flops(self, plan, layout: Layout) -> tuple[float, float]:
        """(training FLOPs, recomputed forward FLOPs) of one budget micro-batch."""
        key = (layout.micro_batch_size, layout.recompute)
        if key not in self._flops:
            job = copy.deepcopy(self.job)
            job.train.micro_batch_size = layout.micro_batch_size
            mb = budget_micro_batch(job, plan.model)
            again = recompute_forward_flops(plan.model, mb, layout.recompute, self.modules)
            self._flops[key] = (mb.flops, again)
        return self._flops[key]

    def busy(self, layout: Layout, plan) -> dict:
        """compute_s, recompute_s, bubble, busy_s: all that needs no dry run."""
        flops, again = self.flops(plan, layout)
        share = plan.grad_accum * plan.dims.dp / self.world / (self.g.bf16_tflops * 1e12)
        bubble = plan.pipeline.bubble if plan.pipeline is not None else 0.0
        compute_s, recompute_s = flops * share, again * share
        return {
            "compute_s": compute_s,
            "recompute_s": recompute_s,
            "bubble": bubble,
            "busy_s": (compute_s + recompute_s) / (1.0 - bubble),
        }

    def step(self, layout: Layout, plan, comm_bytes: dict) -> dict:
        out = self.busy(layout, plan)
        exposed, overlapped = comm_seconds(comm_bytes, plan.dims, self.g)
        step_s = max(out["busy_s"], overlapped) + exposed
        tokens = self.job.train.global_batch_size * self.job.data.pack.seq_len
        return out | {
            "exposed_comm_s": exposed,
            "overlapped_comm_s": overlapped,
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "mfu": out["compute_s"] / step_s,
        }
