"""Which images each context-parallel rank's vision tower encodes: the model's own rule, pure index
logic (no processes), read by context parallel and by the data side's per-rank vision FLOPs.

    shares = balance_images(patches_per_image, cp)   # image indices per rank, each list ascending

Whole images, largest first to the least loaded rank (LPT), so the patches are spread as evenly as
whole images allow.
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


__all__ = ["balance_images"]
