"""Which images each context-parallel rank's vision tower encodes: the model's own rule, pure index
logic (no processes), read by context parallel and by the data side's per-rank vision FLOPs.

    shares = balance_images(patches_per_image, cp)   # image indices per rank, each list ascending
    frames = frame_grids(grids)                       # a video (t, h, w) as t frames (1, h, w)

Whole images, largest first to the least loaded rank (LPT), so the patches are spread as evenly as
whole images allow.  A video's frames are shared as images are: the tower attends within a frame and
places a frame's patches as an image's, so t frames (1, h, w) are the video (t, h, w).
"""

from __future__ import annotations


def balance_images(patches_per_image: list[int], cp: int) -> list[list[int]]:
    """Image indices per rank (each list ascending), whole images, patches balanced largest-first."""
    load, shares = [0] * cp, [[] for _ in range(cp)]
    for i in sorted(range(len(patches_per_image)), key=lambda i: (-patches_per_image[i], i)):
        r = min(range(cp), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += patches_per_image[i]
    return [sorted(s) for s in shares]


def frame_grids(grids: list) -> list[tuple[int, int, int]]:
    """Every grid (t, h, w) as t grids (1, h, w), in order (an image's is itself)."""
    return [(1, h, w) for t, h, w in grids for _ in range(t)]


__all__ = ["balance_images", "frame_grids"]
