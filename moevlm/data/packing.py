"""Packing samples into fixed-shape rows: first fit to the token / patch / image / document budgets
(and the optional vision-FLOPs budget), `collate` into one `PackedRow`, `stack_rows` for B of them.

Legend: S seq_len (token budget), Np max_patches (patch budget), D patch dim, I max_images,
J max_samples (documents), L one sample's tokens, B rows, Nv max_video_patches, V max_videos.

    input_ids (B, S)  labels (B, S)  position_ids (3, B, S)  cu_seqlens (B(J+2),)
    pixel_values (B Np, D)  image_grid_thw (B I, 3)          (one row: B = 1)
    pixel_values_videos (B Nv, D)  video_grid_thw (B V, 3)   (pack.max_videos > 0; else None)

A row's documents lie back to back, then one padding document up to S; its images' patches back to
back, then zero patches up to Np; unused grid rows are zeros.  Stacked rows keep every real patch and
grid first.  Labels are -100 (IGNORE_INDEX) where no loss; the useful/padded counts ride along.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from moevlm.data.config import PackConfig
from moevlm.data.encode import Sample
from moevlm.data.text import IGNORE_INDEX
from moevlm.model.flops import vision_block_forward_parts, vision_forward_flops


class VisionFlops:
    """The vision tower's forward FLOPs of a sample's images (the model's formula), and the per-row
    budget `pack.max_vision_flops` resolves to.  Picklable: the loader's workers build their packers
    with it."""

    def __init__(self, model, max_image_patches: int):
        self.model = model
        self.max_image_patches = max_image_patches  # the largest image the resize allows

    @classmethod
    def for_images(cls, model, image) -> "VisionFlops":
        """For the model `model` and the data's image settings `image` (data.image): the largest image
        is `max_pixels` over the patch area."""
        return cls(model, image.max_pixels // image.patch_size**2)

    def __call__(self, grids) -> float:
        return vision_forward_flops(self.model, grids)[0] if grids else 0.0

    def per_patch(self) -> float:
        """Forward FLOPs of one patch before attention's quadratic term (every part linear in the
        patches): the difference of two grids of 2 and 1 merge blocks of one row, per patch added."""
        m, depth = self.model.vision.spatial_merge_size, self.model.vision.depth

        def linear(grid) -> float:  # the grid's FLOPs less attention's square (every block)
            return (
                self([grid]) - depth * vision_block_forward_parts(self.model, [grid])["core_attn"]
            )

        return (linear((1, m, 2 * m)) - linear((1, m, m))) / (m * m)

    def attention_per_patch(self, image_patches: float) -> float:
        """Forward FLOPs of attention's quadratic term per patch of an image of `image_patches` patches
        (every block: QK^T and PV over the image's patches)."""
        v = self.model.vision
        return (
            v.depth
            * vision_block_forward_parts(self.model, [(1, 1, 1)])["core_attn"]
            * image_patches
        )

    def auto(self, max_patches: int) -> float:
        """The budget "auto": halfway between the lightest full row (max_patches patches of images too
        small for attention to count) and the heaviest (max_patches patches in images of the largest
        size): it cuts the upper half of the range of vision work a row can carry."""
        return max_patches * (
            self.per_patch() + self.attention_per_patch(self.max_image_patches) / 2
        )

    def budget(self, pack: PackConfig) -> float | None:
        """`pack.max_vision_flops` as FLOPs per row; None when off."""
        return vision_budget(pack.max_vision_flops, pack.max_patches, self)


VISION_OFF = ("off", "none", "0", "0.0", "")  # pack.max_vision_flops values that turn the rule off


def vision_budget_set(value) -> bool:
    """Whether `pack.max_vision_flops` asks for a budget (any value but the VISION_OFF ones)."""
    return str(value).strip().lower() not in VISION_OFF


def vision_budget(value, max_patches: int, flops: VisionFlops | None = None) -> float | None:
    """`pack.max_vision_flops` ("off", "auto" or a number of FLOPs) as FLOPs per row, None when off;
    ValueError for any other value (checked before any worker starts)."""
    if not vision_budget_set(value):
        return None
    text = str(value).strip().lower()
    if text == "auto":
        return None if flops is None else flops.auto(max_patches)
    try:
        number = float(text)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise ValueError(
            f"data.pack.max_vision_flops={value!r} is invalid: set it to off, auto or a positive number "
            "of forward FLOPs per packed row"
        )
    return number


class Packer:
    """Holds up to `lookahead` samples; `pop()` returns the samples of the next micro-batch.
    `vision`: the model's VisionFlops, needed when `cfg.max_vision_flops` is not off."""

    def __init__(self, cfg: PackConfig, vision: VisionFlops | None = None):
        self.cfg = cfg
        self.held: list[Sample] = []
        self.budget = vision_budget(cfg.max_vision_flops, cfg.max_patches, vision)
        if vision_budget_set(cfg.max_vision_flops) and vision is None:
            raise ValueError(
                "data.pack.max_vision_flops is set but the packer has no model to count vision FLOPs "
                "with (build the loader with the model config)"
            )
        self.vision = vision
        self.costs: list[float] = []  # the held samples' vision forward FLOPs, in held order
        self.over_budget = 0  # rows of one sample whose own vision FLOPs exceed the budget

    def push(self, sample: Sample) -> None:
        self.held.append(sample)
        grids = sample.grids + sample.video_grids
        self.costs.append(self.vision(grids) if self.budget is not None else 0.0)

    def full(self) -> bool:
        """Ready to emit: the held samples overflow one micro-batch (so it can be
        filled) and at least `lookahead` are held to choose from."""
        return len(self.held) >= self.cfg.lookahead and not self._fit_all()

    def _fit_all(self) -> bool:
        c, h = self.cfg, self.held
        return (
            sum(s.tokens for s in h) <= c.seq_len
            and sum(s.patches for s in h) <= c.max_patches
            and sum(len(s.grids) for s in h) <= c.max_images
            and sum(s.video_patches for s in h) <= c.max_video_patches
            and sum(len(s.video_grids) for s in h) <= c.max_videos
            and len(h) <= c.max_samples
            and (self.budget is None or sum(self.costs) <= self.budget)
        )

    def pop(self) -> list[Sample]:
        c, F = self.cfg, self.budget
        tokens = patches = images = vpatches = videos = 0
        flops = 0.0
        take, keep, kept_costs = [], [], []
        for s, cost in zip(self.held, self.costs):
            fits = (
                tokens + s.tokens <= c.seq_len
                and patches + s.patches <= c.max_patches
                and images + len(s.grids) <= c.max_images
                and vpatches + s.video_patches <= c.max_video_patches
                and videos + len(s.video_grids) <= c.max_videos
                and len(take) < c.max_samples
                # the oldest always goes in: alone when its own vision work is over the budget
                and (F is None or flops + cost <= F or not take)
            )
            if fits:
                take.append(s)
                tokens, patches, images = (
                    tokens + s.tokens,
                    patches + s.patches,
                    images + len(s.grids),
                )
                vpatches, videos = vpatches + s.video_patches, videos + len(s.video_grids)
                flops += cost
            else:
                keep.append(s)
                kept_costs.append(cost)
        self.over_budget += F is not None and flops > F
        self.held, self.costs = keep, kept_costs
        return take


@dataclass(frozen=True, eq=False)
class PackedRow(Mapping):
    """One packed row (`collate`, B = 1) or B of them stacked (`stack_rows`): fixed-shape tensors and the
    counts of what is real in them.  Read by attribute, or by name as a read-only mapping
    (`row["input_ids"]`, `row.items()`)."""

    input_ids: torch.Tensor  # (B, S)
    labels: torch.Tensor  # (B, S), IGNORE_INDEX where no loss
    position_ids: torch.Tensor  # (3, B, S) M-RoPE positions
    cu_seqlens: torch.Tensor  # (B(J+2),) int32 document ends, then S repeated (per row, offset r*S)
    pixel_values: torch.Tensor  # (B Np, D), real patches first
    image_grid_thw: torch.Tensor  # (B I, 3), real grids first, zero rows after
    num_samples: int  # documents
    num_images: int
    useful_tokens: int
    padded_tokens: int
    loss_tokens: int  # the model's targets: labels shifted by one inside each document
    useful_patches: int
    padded_patches: int
    sample_ids: list[str]
    # videos as the images (pack.max_videos > 0; None and 0 otherwise)
    pixel_values_videos: torch.Tensor | None = None  # (B Nv, D), real patches first
    video_grid_thw: torch.Tensor | None = None  # (B V, 3), real grids first, zero rows after
    num_videos: int = 0
    video_patches: int = 0  # real video patches

    def __getitem__(self, name: str):
        if name not in _ROW_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_ROW_FIELDS)

    def __len__(self) -> int:
        return len(_ROW_FIELDS)

    def pin_memory(self) -> PackedRow:
        """A copy with the tensors in page-locked memory (torch's DataLoader calls it)."""
        tensors = {k: getattr(self, k) for k in _ROW_TENSORS}
        return dataclasses.replace(
            self, **{k: v.pin_memory() for k, v in tensors.items() if v is not None}
        )


_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(PackedRow))
_ROW_TENSORS = _ROW_FIELDS[:6] + ("pixel_values_videos", "video_grid_thw")
COUNTS = (
    "num_samples",
    "num_images",
    "useful_tokens",
    "padded_tokens",
    "loss_tokens",
    "useful_patches",
    "padded_patches",
    "num_videos",
    "video_patches",
)


def collate(samples: list[Sample], cfg: PackConfig, patch_dim: int, pad_id: int) -> PackedRow:
    """Samples (that fit the budgets) -> one packed row of fixed-shape tensors + counts."""
    S, Np, I, J = cfg.seq_len, cfg.max_patches, cfg.max_images, cfg.max_samples
    used = sum(s.tokens for s in samples)
    input_ids = torch.full((S,), pad_id, dtype=torch.long)
    labels = torch.full((S,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(3, S, dtype=torch.long)
    cu = torch.full((J + 2,), S, dtype=torch.int32)
    cu[0], at = 0, 0
    for j, s in enumerate(samples):
        input_ids[at : at + s.tokens] = s.input_ids_L
        labels[at : at + s.tokens] = s.labels_L
        position_ids[:, at : at + s.tokens] = s.position_ids_3L
        at += s.tokens
        cu[j + 1] = at
    # the padding document counts from 0 like any other
    position_ids[:, used:] = torch.arange(S - used)

    grids = [g for s in samples for g in s.grids]
    pixels = torch.zeros(Np, patch_dim, dtype=torch.float32)
    pieces = [s.pixels_ND for s in samples if s.pixels_ND is not None]
    patches = sum(p.shape[0] for p in pieces)
    if pieces:
        torch.cat(pieces, out=pixels[:patches])
    grid_thw = torch.zeros(I, 3, dtype=torch.long)
    if grids:
        grid_thw[: len(grids)] = torch.tensor(grids, dtype=torch.long)
    videos = _videos(samples, cfg, patch_dim)
    return PackedRow(
        input_ids=input_ids[None],
        labels=labels[None],
        position_ids=position_ids[:, None],
        cu_seqlens=cu,
        pixel_values=pixels,
        image_grid_thw=grid_thw,
        num_samples=len(samples),
        num_images=len(grids),
        useful_tokens=used,
        padded_tokens=S - used,
        loss_tokens=int(sum(int((s.labels_L[1:] != IGNORE_INDEX).sum()) for s in samples)),
        useful_patches=patches,
        padded_patches=Np - patches,
        sample_ids=[s.id for s in samples],
        **videos,
    )


def _videos(samples: list[Sample], cfg: PackConfig, patch_dim: int) -> dict:
    """The row's video fields: pixels (Nv, D) and grids (V, 3), real first; none when max_videos=0."""
    if not cfg.max_videos:
        return {}
    pixels = torch.zeros(cfg.max_video_patches, patch_dim, dtype=torch.float32)
    pieces = [s.video_pixels_ND for s in samples if s.video_pixels_ND is not None]
    n = sum(p.shape[0] for p in pieces)
    if pieces:
        torch.cat(pieces, out=pixels[:n])
    grids = [g for s in samples for g in s.video_grids]
    grid_thw = torch.zeros(cfg.max_videos, 3, dtype=torch.long)
    if grids:
        grid_thw[: len(grids)] = torch.tensor(grids, dtype=torch.long)
    return dict(
        pixel_values_videos=pixels, video_grid_thw=grid_thw, num_videos=len(grids), video_patches=n
    )


def _real_first(parts: list[torch.Tensor], rows: int) -> torch.Tensor:
    """The parts back to back, then zero rows up to `rows`; page-locked where the parts are (the
    loader pins its rows on a CUDA machine, and the step's copy to the device stays asynchronous)."""
    first = parts[0]
    out = torch.zeros(rows, *first.shape[1:], dtype=first.dtype, pin_memory=first.is_pinned())
    n = sum(p.shape[0] for p in parts)
    torch.cat(parts, out=out[:n])
    return out


def stack_rows(rows: list[PackedRow]) -> PackedRow:
    """B packed rows (of one PackConfig) -> one micro-batch of B rows: each row's cu_seqlens offset by
    r*S (documents never attend across rows), every real patch and grid before the padding.  One row
    is its own micro-batch, not a copy (a row already holds its real patches and grids first, zeros
    after): copying it cost the trainer's main thread ~30 ms a row at 4096 patches, and the copy was
    no longer page-locked."""
    if len(rows) == 1:
        return rows[0]
    return _stacked(rows)


def _stacked(rows: list[PackedRow]) -> PackedRow:
    S = rows[0].input_ids.shape[1]
    pixels = _real_first(
        [r.pixel_values[: r.useful_patches] for r in rows],
        sum(r.pixel_values.shape[0] for r in rows),
    )
    grid_thw = _real_first(
        [r.image_grid_thw[: r.num_images] for r in rows],
        sum(r.image_grid_thw.shape[0] for r in rows),
    )
    videos = {}
    if rows[0].pixel_values_videos is not None:
        videos = dict(
            pixel_values_videos=_real_first(
                [r.pixel_values_videos[: r.video_patches] for r in rows],
                sum(r.pixel_values_videos.shape[0] for r in rows),
            ),
            video_grid_thw=_real_first(
                [r.video_grid_thw[: r.num_videos] for r in rows],
                sum(r.video_grid_thw.shape[0] for r in rows),
            ),
        )
    return PackedRow(
        input_ids=torch.cat([r.input_ids for r in rows]),
        labels=torch.cat([r.labels for r in rows]),
        position_ids=torch.cat([r.position_ids for r in rows], dim=1),
        cu_seqlens=torch.cat([r.cu_seqlens + i * S for i, r in enumerate(rows)]),
        pixel_values=pixels,
        image_grid_thw=grid_thw,
        **{k: sum(getattr(r, k) for r in rows) for k in COUNTS},
        sample_ids=[sid for r in rows for sid in r.sample_ids],
        **videos,
    )
