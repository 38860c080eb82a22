"""Pipeline parallelism: the model cut into stages, run by torch.distributed.pipelining.
Legend: B rows per micro-batch, S sequence, D hidden, Np (Nv) image (video) patches per row, E experts.

    prune_to_stages(model, plan, pp_rank)              # on meta, before TP/EP/FSDP (build_model)
    pipe = Pipeline(model, plan, pp_rank, pp_group)     # build_model; FSDP roots on its stages
    pipe.start(device, rows=B, seq_len=S, max_patches=Np, seq_shards=cp*tp, ...)  # torch's schedule
                                                        # (max_video_patches=Nv with videos)
    micro = pipe.share(micro if pp_rank == 0 else None, device)   # the step's inputs, every pp rank
    lm_sum, aux, counts = pipe.forward_backward(micro_batches, loss_tokens, aux_divisor)
    lm_sum = pipe.forward_only(micro_batches)           # validation: no backward, no schedule

Between stages: h (B, S/(cp x tp), D), the deepstack features still to be added and the router
statistics (2E+3,) fp32; the last stage forms the objective (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from moevlm.model.moe import RouterStats, global_balance_loss, layer_extras, load_balancing_loss
from moevlm.model.objective import objective
from moevlm.parallel.pipeline_schedules import SCHEDULES
from moevlm.parallel.pipeline_split import PipelineSplit


def prune_to_stages(model: nn.Module, plan: PipelineSplit, pp_rank: int) -> list[int]:
    """Keep only the parts of the (meta) model that this pp rank's stages hold; returns the stages."""
    stages = plan.stages_of(pp_rank)
    keep = {i for s in stages for i in plan.layer_range(s)}
    text = model.text
    text.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(text.layers) if i in keep})
    if 0 not in stages:
        model.vision = None
        text.embed_tokens = None
    if plan.num_stages - 1 not in stages:
        text.norm = None
        model.lm_head = None
    return stages


class StageModule(nn.Module):
    """Stage `index` of the pipeline, over the modules of the rank's pruned model."""

    def __init__(
        self, model: nn.Module, plan: PipelineSplit, index: int, batches: list, autocast: Callable
    ):
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: its parameters are registered below, once
        self.__dict__["batches"] = (
            batches  # the step's MicroBatches, filled by Pipeline.forward_backward
        )
        self.__dict__["autocast"] = autocast
        cfg = model.config
        self.index, self.first, self.last = index, index == 0, index == plan.num_stages - 1
        # Pipeline.forward_only: the last stage returns the summed token loss
        self.evaluating = False
        span = plan.layer_range(index)
        self.layers = nn.ModuleDict({str(i): model.text.layers[str(i)] for i in span})
        if self.first:
            self.vision, self.embed_tokens = model.vision, model.text.embed_tokens
        if self.last:
            self.norm, self.lm_head = model.text.norm, model.lm_head
        n_ds = len(cfg.vision.deepstack_visual_indexes)
        self.ds_in = [] if self.first else [k for k in range(n_ds) if k >= span.start]
        self.ds_out = [] if self.last else [k for k in range(n_ds) if k >= span.stop]
        self.num_experts = cfg.moe.num_experts
        self.moe_layers = sum(cfg.moe.is_moe_layer(i) for i in range(cfg.text.num_layers))
        # moe.aux_loss=global_batch: a StepFrequencies (Pipeline.frequencies sets it)
        self.frequencies = None
        # what crosses the boundary (Pipeline.start sets them): dtypes, deepstack rows
        self.h_dtype = self.vision_dtype = torch.float32
        self.ds_rows = 0
        self.records: list[dict] = []
        self.loss_tokens, self.aux_divisor = (
            1.0,
            1,
        )  # the step's objective (set by Pipeline.forward_backward)

    def forward(self, *acts: torch.Tensor, mb: torch.Tensor):
        model, b = self.model, self.batches[int(mb)]
        model.strategies.sequence.begin(b.cu_seqlens, *b.input_ids.shape, b.input_ids.device)
        with self.autocast():
            if self.first:
                h, visual_mask, ds_list, n = model.embed(
                    b.input_ids,
                    b.pixel_values,
                    b.image_grid_thw,
                    b.pixel_values_videos,
                    b.video_grid_thw,
                )
                deepstack = dict(enumerate(self._boundary_rows(ds_list)))
                h = model.text.seq.enter(h)
                stats = None
            else:
                h, *rows, stats = acts if self.num_experts else (*acts, None)
                deepstack = dict(zip(self.ds_in, rows))
                cfg = model.config
                visual_mask = (b.input_ids == cfg.image_token_id) | (
                    b.input_ids == cfg.video_token_id
                )
                n = b.n_image + b.n_video
            ctx = model.text.layer_inputs(b.position_ids, b.cu_seqlens, b.token_mask, h.dtype)
            here = {k: deepstack[k][:n] for k in deepstack if str(k) in self.layers}
            h, layer_stats = model.text.run_layers(h, ctx, visual_mask, here, self.layers)
            stats = self._add_stats(stats, layer_stats, h)
            if self.last and self.evaluating:
                lm_loss, n = model.head_loss(self.norm(h), b.labels, b.cu_seqlens)
                return (lm_loss * n).float().reshape(1)
            if self.last:
                return self._objective(h, b, stats)
        out = [h.to(self.h_dtype), *(deepstack[k].to(self.vision_dtype) for k in self.ds_out)]
        return tuple(_not_a_view(t) for t in (out if stats is None else [*out, stats]))

    def _boundary_rows(self, ds_list: list) -> list:
        """The first stage's deepstack features at the boundary's static row count: the images' and
        videos' rows, then zero rows up to the patch budgets (a micro-batch without videos)."""
        if not self.ds_out:
            return ds_list
        have = ds_list[0].shape[0]
        if have > self.ds_rows:
            raise ValueError(
                f"pipeline: a micro-batch's images and videos make {have} deepstack rows, above the "
                f"{self.ds_rows} its stage boundary was built for (Pipeline.start's max_patches + "
                "max_video_patches, per row): raise the budget given there"
            )
        return [torch.cat([d, d.new_zeros(self.ds_rows - have, d.shape[1])]) for d in ds_list]

    def _add_stats(self, stats, layer_stats: list[RouterStats], h) -> torch.Tensor | None:
        """Accumulate this stage's router statistics into the travelling (2E+3,) vector."""
        record = {
            "counts": torch.stack([s.counts_E for s in layer_stats]).detach()
            if layer_stats
            else None
        }
        self.records.append(record)
        if not self.num_experts:
            return None
        if layer_stats:
            n = torch.stack(
                [
                    torch.as_tensor(s.num_tokens, dtype=torch.float32, device=h.device).reshape(())
                    for s in layer_stats
                ]
            ).sum()
            local = torch.cat(
                [
                    torch.stack([s.prob_sum_E for s in layer_stats]).sum(0),
                    torch.stack([s.counts_E for s in layer_stats]).sum(0),
                    n[None],
                    *(
                        torch.zeros(1, device=h.device) if x is None else x.reshape(1)
                        for x in layer_extras(layer_stats, self.num_experts)
                    ),
                ]
            ).float()
            stats = local if stats is None else stats + local
        elif stats is None:
            stats = h.new_zeros(2 * self.num_experts + 3, dtype=torch.float32)
        # a first stage without MoE layers: tie the vector to the graph (exact zero)
        if not stats.requires_grad:
            stats = stats + h.float().sum() * 0
        return stats

    def _objective(self, h, b, stats) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        lm_loss, n = model.head_loss(self.norm(h), b.labels, b.cu_seqlens)
        lm_sum = lm_loss * n
        aux = z = None
        # the load-balancing loss over every layer, from the sums of all stages
        if stats is not None:
            E, moe = self.num_experts, cfg.moe
            total = RouterStats(
                stats[:E], counts_E=stats[E : 2 * E].detach(), num_tokens=stats[2 * E].detach()
            )
            if moe.aux_loss == "sequence":
                aux = stats[2 * E + 1] / self.moe_layers
            elif moe.aux_loss == "global_batch":
                freq_E = self.frequencies(total.counts_E, total.num_tokens)
                aux = global_balance_loss(total.prob_sum_E, total.num_tokens, freq_E, E)
            else:
                aux = load_balancing_loss([total], E)
            z = stats[2 * E + 2] if moe.z_loss_coeff > 0 else None
        loss = objective(
            lm_sum,
            self.loss_tokens,
            aux,
            cfg.moe.router_aux_loss_coef,
            self.aux_divisor,
            z,
            cfg.moe.z_loss_coeff,
        )
        self.records[-1].update(lm_sum=lm_sum.detach(), aux=None if aux is None else aux.detach())
        return _not_a_view(loss.reshape(1).float())


class Pipeline:
    """This rank's stages of the pipeline and the schedule that runs them."""

    def __init__(self, model: nn.Module, plan: PipelineSplit, pp_rank: int, pp_group):
        self.plan, self.pp_rank, self.group = plan, pp_rank, pp_group
        self.batches: list = []  # the step's MicroBatches
        self.modules = [
            StageModule(model, plan, s, self.batches, contextlib.nullcontext)
            for s in plan.stages_of(pp_rank)
        ]
        self.schedule, self.device = None, torch.device("cpu")  # both set by start()
        self.inputs: dict[int, tuple] = {}  # stage -> its boundary inputs on meta (set by start())
        self.first_rank = dist.get_global_rank(pp_group, 0) if pp_group is not None else 0

    @property
    def holds_first(self) -> bool:
        return any(m.first for m in self.modules)

    @property
    def holds_last(self) -> bool:
        return any(m.last for m in self.modules)

    # -------------------------------------------------------------- schedule
    def start(
        self,
        device: torch.device,
        *,
        rows: int,
        seq_len: int,
        max_patches: int,
        seq_shards: int,
        h_dtype: torch.dtype,
        vision_dtype: torch.dtype,
        autocast: Callable | None = None,
        max_video_patches: int = 0,
    ) -> None:
        """Build torch's PipelineStage for every local stage (with the static boundary shapes) and the
        schedule.  `autocast` (a context factory) wraps every stage's forward; `max_patches` and
        `max_video_patches`: a row's image and video patch budgets (the deepstack rows that cross)."""
        from torch.distributed import pipelining

        self.device = device
        for m in self.modules:
            m.__dict__["autocast"] = autocast or contextlib.nullcontext
            m.h_dtype, m.vision_dtype = h_dtype, vision_dtype

        cfg = self.modules[0].model.config
        D, merge = cfg.text.hidden_size, cfg.vision.spatial_merge_size
        meta = dict(device="meta", requires_grad=True)
        # the sequence over cp x tp
        h = torch.empty(rows, seq_len // seq_shards, D, dtype=h_dtype, **meta)
        ds_rows = rows * (max_patches + max_video_patches) // merge**2
        ds = torch.empty(ds_rows, D, dtype=vision_dtype, **meta)
        stats = (
            [torch.empty(2 * cfg.moe.num_experts + 3, dtype=torch.float32, **meta)]
            if cfg.moe.num_experts
            else []
        )
        stages = []
        for m in self.modules:
            m.ds_rows = ds_rows
            if not ds_rows:  # text-only budgets: no image, no video, no deepstack
                m.ds_in, m.ds_out = [], []
            ins = (
                (torch.empty(1, dtype=torch.long, device="meta"),)
                if m.first
                else (h, *[ds] * len(m.ds_in), *stats)
            )
            outs = (
                (torch.empty(1, dtype=torch.float32, **meta),)
                if m.last
                else (h, *[ds] * len(m.ds_out), *stats)
            )
            self.inputs[m.index] = ins
            stages.append(
                pipelining.PipelineStage(
                    m,
                    m.index,
                    self.plan.num_stages,
                    device,
                    input_args=ins,
                    output_args=outs,
                    group=self.group,
                )
            )
        cls = getattr(pipelining, SCHEDULES[self.plan.schedule][0])
        kw = dict(
            n_microbatches=self.plan.microbatches, loss_fn=_objective_is_the_loss, scale_grads=False
        )
        self.schedule = cls(stages[0], **kw) if self.plan.vpp == 1 else cls(stages, **kw)

    # ------------------------------------------------------------------ step
    def share(self, micro: list | None, device: torch.device) -> list:
        """The step's micro-batches on every rank of the pipeline group: the first stage's rank read
        them; the others receive them without the pixels (one broadcast; they never decode images)."""
        box = [[mb.without_images() for mb in micro] if self.pp_rank == 0 else None]
        dist.broadcast_object_list(
            box,
            src=self.first_rank,
            group=self.group,
            device=device if device.type == "cuda" else None,
        )
        return micro if self.pp_rank == 0 else box[0]

    def set_frequencies(self, frequencies) -> None:
        """moe.aux_loss=global_batch: the StepFrequencies the last stage reads (moevlm.parallel.balance)."""
        for m in self.modules:
            m.frequencies = frequencies

    def forward_backward(self, micro: list, loss_tokens: float, aux_divisor: int):
        """Run the schedule over the step's MicroBatches (on the device); `aux_divisor` = M x dp.
        Returns this rank's (sum of token losses, sum of aux losses / (M x dp), expert counts of its
        layers summed over micro-batches): the loss sums are non-zero on the last stage only."""
        self.batches[:] = micro
        for m in self.modules:
            m.records.clear()
            m.loss_tokens, m.aux_divisor = loss_tokens, aux_divisor
        ids = torch.arange(len(micro))
        args = (ids,) if self.holds_first else ()
        self.schedule.step(
            *args, target=ids if self.holds_last else None, return_outputs=False, mb=ids
        )
        # summed where they were computed: no host sync
        lm_sum = aux = torch.zeros((), device=self.device)
        counts = None
        for m in self.modules:
            for r in m.records:
                if r.get("lm_sum") is not None:
                    lm_sum = lm_sum + r["lm_sum"].float()
                if r.get("aux") is not None:
                    aux = aux + r["aux"].float() / aux_divisor
            layer_counts = [r["counts"] for r in m.records if r["counts"] is not None]
            if layer_counts:
                c = torch.stack(layer_counts).sum(0)
                counts = c if counts is None else torch.cat([counts, c])
        self.batches.clear()
        return lm_sum, aux, counts

    def forward_only(self, micro: list) -> torch.Tensor:
        """The micro-batches (on the device) through every stage without backward (call it under
        torch.no_grad): this rank's sum of their token losses, non-zero on the last stage only."""
        self.batches[:] = micro
        mine = {m.index: m for m in self.modules}
        lm_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for m in mine.values():
                m.evaluating = True
            for i in range(len(micro)):
                lm_sum = lm_sum + self._forward_one(i, mine)
        finally:
            for m in mine.values():
                m.evaluating = False
                m.records.clear()
            self.batches.clear()
        return lm_sum

    def _forward_one(self, i: int, mine: dict) -> torch.Tensor:
        """Micro-batch i through the stages in order; what crosses ranks goes by send/recv."""
        plan, acts, out = self.plan, (), torch.zeros((), dtype=torch.float64, device=self.device)
        mb = torch.tensor(i)
        for s in range(plan.num_stages):
            if s not in mine:
                continue
            if s > 0 and plan.rank_of(s - 1) != self.pp_rank:
                acts = tuple(
                    torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in self.inputs[s]
                )
                for t in acts:
                    dist.recv(t, group=self.group, group_src=plan.rank_of(s - 1))
            result = mine[s](*acts, mb=mb) if s > 0 else mine[s](mb, mb=mb)
            if mine[s].last:
                out = result.double().sum()
                continue
            acts = result
            if plan.rank_of(s + 1) != self.pp_rank:
                for t in acts:
                    dist.send(t.contiguous(), group=self.group, group_dst=plan.rank_of(s + 1))
        return out


def v_schedules_supported(backend: str) -> bool:
    """Whether zbv / dualpipev (two stages of one rank next to each other) can start on `backend`:
    torch 2.11's stage start-up sends from a rank to itself, which NCCL accepts and gloo does not;
    later torch warms stages up without it (probed by that method, not by version)."""
    from torch.distributed.pipelining import PipelineStage

    return backend != "gloo" or hasattr(PipelineStage, "_warmup_forward_vote")


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    """Stage outputs own their storage: torch's zero-bubble backward detaches them in place, and FSDP's
    hooks on a view can be lost (the vision tower's deepstack rows are views of its outputs)."""
    return t.clone() if t._base is not None else t


def _objective_is_the_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The last stage already returns its micro-batch's share of the objective (torch's schedule
    requires a target there; it is the micro-batch index)."""
    return output.sum()


__all__ = ["Pipeline", "StageModule", "prune_to_stages", "v_schedules_supported"]
