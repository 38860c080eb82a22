"""Vision work per data-parallel rank, measured from packed rows alone (no processes, no model).

    table = measure(data_cfg, model_cfg, dp=4, steps=12, rows_per_step=4)
    table["max_over_mean"], table["token_fill"], table["patch_fill"]

Design choices:
- What the trainer logs as `vision_flops_max_over_mean`, computed in one process: one loader per
  data-parallel rank (`build_loader(rank=r, world=dp)`, so each owns the streams the loader gives it and
  delivers their rows in the loader's order), `rows_per_step` rows per rank per step (grad_accum x
  micro_batch_size) in micro-batches of `micro_batch_size` rows; each rank's figure per micro-batch is
  its rows' vision FLOPs (training FLOPs as `moevlm.model.flops.count_flops` counts them: the quadratic
  attention term per image).  Per micro-batch, not per step: the ranks meet at every micro-batch under
  FSDP (its reduce-scatter) and expert parallelism (the all-to-alls), so a step's sum per rank would
  average the straggler away.
- Under context parallelism each cp rank encodes a share of each micro-batch's whole images
  (`cp_layout.balance_images`): the figures are then per (dp, cp) rank, the slowest of them being
  what the reduction waits for; tp ranks encode the same images and count once.
- The window figure is the sum over micro-batches of the max over ranks, divided by the sum of the
  means: the share of vision time the slowest rank adds where the ranks meet, weighted by the
  micro-batches' vision work (one without images weighs nothing).  The trainer's record uses the same
  definition over its log window (`moevlm.train.metrics.Window`).
- Fill rates are the packer's: useful over budget, tokens of seq_len and patches of max_patches, over
  all rows measured.
"""

from __future__ import annotations

from moevlm.data.config import DataConfig
from moevlm.data.packing import VisionFlops


def max_over_mean(per_micro: list[list[float]]) -> float | None:
    """Sum over micro-batches of the max over ranks / sum of the means; None without vision work."""
    top = sum(max(ranks) for ranks in per_micro)
    mean = sum(sum(ranks) / len(ranks) for ranks in per_micro)
    return top / mean if mean > 0 else None


def measure(
    cfg: DataConfig,
    model,
    *,
    dp: int,
    steps: int,
    rows_per_step: int,
    cp: int = 1,
    micro_batch_size: int = 1,
) -> dict:
    """Reads `steps` x `rows_per_step` rows on each of `dp` ranks' loaders (in this process: set
    cfg.num_workers=0 for no worker processes) and returns the balance and fill figures.  Each
    micro-batch of `micro_batch_size` rows (`micro_batches` per step, micro-batch j of step k at
    `per_micro[k * micro_batches + j]`) has dp x cp figures, rank r's cp share c at r * cp + c: it hands
    its images out to the cp ranks as the model does (`moevlm.data.batch.vision_flops_by_cp`)."""
    from moevlm.data.batch import vision_flops_by_cp
    from moevlm.data.loader import build_loader

    vision = VisionFlops.for_images(model, cfg.image)
    micro_batches = -(-rows_per_step // micro_batch_size)
    per_micro = [[0.0] * (dp * cp) for _ in range(steps * micro_batches)]
    forward = []  # each row's vision forward FLOPs (what the budget bounds) and its images
    tokens = patches = rows = over = 0
    for r in range(dp):
        with build_loader(cfg, model, rank=r, world=dp) as loader:
            for k in range(steps):
                micro, j = [], k * micro_batches
                for i in range(rows_per_step):
                    row = next(loader)
                    grids = row["image_grid_thw"][: row["num_images"]].tolist()
                    forward.append((vision(grids), len(grids)))
                    micro += grids
                    if (i + 1) % micro_batch_size == 0 or i + 1 == rows_per_step:
                        for c, flops in enumerate(vision_flops_by_cp(micro, model, cp)):
                            per_micro[j][r * cp + c] = flops
                        micro, j = [], j + 1
                    tokens += row["useful_tokens"]
                    patches += row["useful_patches"]
                    rows += 1
            over += loader.stats()["over_vision_budget"]
    pk = cfg.pack
    return {
        "max_over_mean": max_over_mean(per_micro),
        "worst_micro": max(max(s) / (sum(s) / len(s)) for s in per_micro if sum(s) > 0),
        "token_fill": tokens / (rows * pk.seq_len),
        "patch_fill": patches / (rows * pk.max_patches) if pk.max_patches else None,
        "rows": rows,
        "over_budget_rows": over,
        "budget": vision.budget(pk),
        "row_forward": forward,
        "per_micro": per_micro,
        "micro_batches": micro_batches,
    }
