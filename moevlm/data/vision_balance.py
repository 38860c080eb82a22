"""Vision work per data-parallel rank, measured from packed rows alone (no processes, no model):
what the trainer logs as `vision_flops_max_over_mean`, computed in one process.

    table = measure(data_cfg, model_cfg, dp=4, steps=12, rows_per_step=4)
    table["max_over_mean"], table["token_fill"], table["patch_fill"]

One loader per data-parallel rank; per micro-batch, each (dp, cp) rank's training vision FLOPs;
the figure is the sum over micro-batches of the max over ranks divided by the sum of the means.
"""

from __future__ import annotations

from moevlm.data.batch import vision_flops_by_cp
from moevlm.data.config import DataConfig
from moevlm.data.loader import build_loader
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
    its images and videos out to the cp ranks as the model does (`moevlm.data.batch.vision_flops_by_cp`)."""
    vision = VisionFlops.for_images(model, cfg.image)
    micro_batches = -(-rows_per_step // micro_batch_size)
    per_micro = [[0.0] * (dp * cp) for _ in range(steps * micro_batches)]
    forward = []  # each row's vision forward FLOPs (what the budget bounds) and its images
    tokens = patches = rows = over = 0
    for r in range(dp):
        with build_loader(cfg, model, rank=r, world=dp) as loader:
            for k in range(steps):
                micro, videos, j = [], [], k * micro_batches
                for i in range(rows_per_step):
                    row = next(loader)
                    grids = row.image_grid_thw[: row.num_images].tolist()
                    vgrids = (
                        [] if not row.num_videos else row.video_grid_thw[: row.num_videos].tolist()
                    )
                    forward.append((vision(grids + vgrids), len(grids) + len(vgrids)))
                    micro, videos = micro + grids, videos + vgrids
                    if (i + 1) % micro_batch_size == 0 or i + 1 == rows_per_step:
                        # the micro-batch's images, then its videos, as MicroBatch.with_videos counts them
                        for c, flops in enumerate(vision_flops_by_cp(micro + videos, model, cp)):
                            per_micro[j][r * cp + c] = flops
                        micro, videos, j = [], [], j + 1
                    tokens += row.useful_tokens
                    patches += row.useful_patches
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
