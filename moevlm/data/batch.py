"""One micro-batch as the model and the trainer take it: `B` packed rows stacked, with its counts.

Legend: B rows, S seq_len, J max_samples, Np max_patches, I max_images, D patch dim.

    mb = MicroBatch.read(loader, rows_per_batch=B, model=model_cfg, freeze_vision=False)   # B rows
    mb = mb.to(device)                 # grids and cu_seqlens stay on the host (HOST_INPUTS)
    out = model(**mb.forward_kwargs())  # model_inputs() and the visual token counts
    mb.loss_tokens, mb.useful_tokens, mb.flops, mb.images, mb.n_image          # the counts ride along

A text-only patch budget gives `pixel_values = image_grid_thw = None`; videos ride in
`pixel_values_videos`/`video_grid_thw` (`mb.with_videos(...)`, None without).  FLOPs count the real documents
and images only; `vision_flops_cp` is each context-parallel rank's share (image_shares.balance_images).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from moevlm.data.packing import PackedRow, stack_rows
from moevlm.model.flops import count_flops
from moevlm.model.image_shares import balance_images, frame_grids


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, S)
    labels: torch.Tensor  # (B, S), -100 where no loss
    position_ids: torch.Tensor  # (3, B, S) M-RoPE positions
    cu_seqlens: torch.Tensor  # (B(J+2),) int32 document boundaries in the flattened B*S tokens
    # (B, S) bool, True at real tokens (padding stays out of router statistics)
    token_mask: torch.Tensor
    pixel_values: torch.Tensor | None  # (B Np, D), real patches first
    image_grid_thw: torch.Tensor | None  # (B I, 3), real grids first, zero rows after
    loss_tokens: int  # tokens with a target
    useful_tokens: int  # real tokens (padding excluded)
    flops: float  # model FLOPs of the real documents and images, training
    n_image: int  # merged image rows (= image tokens in the text)
    images: int  # real images (grids)
    # training vision FLOPs each context-parallel rank's tower spends on this micro-batch (its share of the
    # images, image_shares.balance_images; one entry without CP)
    vision_flops_cp: tuple[float, ...] = (0.0,)
    # videos, laid out as the images are; None without videos (with_videos attaches them)
    pixel_values_videos: torch.Tensor | None = None  # (B Nv, D), real patches first
    video_grid_thw: torch.Tensor | None = None  # (B V, 3), real grids first, zero rows after
    n_video: int = 0  # merged video rows (= video tokens in the text)
    videos: int = 0  # real videos (grids)

    MODEL_INPUTS: ClassVar[tuple[str, ...]] = (
        "input_ids",
        "pixel_values",
        "image_grid_thw",
        "position_ids",
        "cu_seqlens",
        "labels",
        "token_mask",
    )
    VIDEO_INPUTS: ClassVar[tuple[str, ...]] = ("pixel_values_videos", "video_grid_thw")
    # stay on the host in `to(device)`: the model reads their values on the host (shapes, checks,
    # rotary tables, document bounds, the context-parallel split), so a device copy would cost a
    # device-to-host read each; where a kernel needs them on the device the model copies them there
    HOST_INPUTS: ClassVar[tuple[str, ...]] = ("image_grid_thw", "video_grid_thw", "cu_seqlens")

    @classmethod
    def read(
        cls, rows, *, rows_per_batch: int, model, freeze_vision: bool = False, cp: int = 1
    ) -> MicroBatch:
        """The next `rows_per_batch` packed rows of the iterator `rows` (a loader) as one micro-batch;
        `cp`: the context-parallel size (the vision work per cp rank)."""
        return cls.from_rows([next(rows) for _ in range(rows_per_batch)], model, freeze_vision, cp)

    @classmethod
    def from_rows(
        cls, rows: list[PackedRow], model, freeze_vision: bool = False, cp: int = 1
    ) -> MicroBatch:
        """Packed rows (`packing.collate`) of one micro-batch; `model` is the VLMConfig (FLOPs,
        merge size)."""
        b = stack_rows(rows)
        S = b.input_ids.shape[1]
        text_only = b.pixel_values.shape[0] == 0
        mb = cls(
            input_ids=b.input_ids,
            labels=b.labels,
            position_ids=b.position_ids,
            cu_seqlens=b.cu_seqlens,
            token_mask=torch.stack([torch.arange(S) < r.useful_tokens for r in rows]),
            pixel_values=None if text_only else b.pixel_values,
            image_grid_thw=None if text_only else b.image_grid_thw,
            loss_tokens=b.loss_tokens,
            useful_tokens=b.useful_tokens,
            flops=sum(row_flops(r, model, freeze_vision) for r in rows),
            n_image=b.useful_patches // model.vision.spatial_merge_size**2,
            images=b.num_images,
            vision_flops_cp=vision_flops_by_cp(
                b.image_grid_thw[: b.num_images].tolist(), model, cp, freeze_vision
            ),
        )
        if b.pixel_values_videos is None:
            return mb
        return mb.with_videos(b.pixel_values_videos, b.video_grid_thw, model, freeze_vision, cp)

    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of the model's forward (the video ones only with videos)."""
        videos = self.VIDEO_INPUTS if self.pixel_values_videos is not None else ()
        return {k: getattr(self, k) for k in self.MODEL_INPUTS + videos}

    def forward_kwargs(self) -> dict:
        """`model_inputs()` and the visual token counts the loader placed (`visual_tokens`): what the
        trainer passes the model, whose input checks then read nothing from the device."""
        return {**self.model_inputs(), "visual_tokens": (self.n_image, self.n_video)}

    def to(self, device: torch.device) -> MicroBatch:
        """A copy with the tensors on `device` (non-blocking; counts unchanged), but `HOST_INPUTS`."""
        moved = {
            k: None if v is None else v.to(device, non_blocking=True)
            for k, v in self.model_inputs().items()
            if k not in self.HOST_INPUTS
        }
        return dataclasses.replace(self, **moved)

    def without_images(self) -> MicroBatch:
        """A copy without the pixels and grids (images and videos): what a pipeline stage after the
        first needs."""
        return dataclasses.replace(
            self,
            pixel_values=None,
            image_grid_thw=None,
            pixel_values_videos=None,
            video_grid_thw=None,
        )

    def with_videos(
        self,
        pixel_values_videos: torch.Tensor,
        video_grid_thw: torch.Tensor,
        model,
        freeze_vision: bool = False,
        cp: int = 1,
    ) -> MicroBatch:
        """A copy carrying the micro-batch's videos (real patches and grids first, zero grid rows
        after), their training vision FLOPs added to `flops` and to `vision_flops_cp` (images and
        videos balanced over the context-parallel ranks together)."""
        real = video_grid_thw[video_grid_thw.prod(-1) > 0].tolist()
        images = [] if self.image_grid_thw is None else self.image_grid_thw[: self.images].tolist()
        added = count_flops(model, [], real, training=True, freeze_vision=freeze_vision).vision
        return dataclasses.replace(
            self,
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw,
            n_video=sum(t * h * w for t, h, w in real) // model.vision.spatial_merge_size**2,
            videos=len(real),
            flops=self.flops + added,
            vision_flops_cp=vision_flops_by_cp(images + real, model, cp, freeze_vision),
        )


def vision_flops_by_cp(grids: list, model, cp: int, freeze_vision: bool = False) -> tuple:
    """Training vision FLOPs of each context-parallel rank's share of the images `grids` (whole images,
    as moevlm.model.image_shares.balance_images hands them out, a video's frames as images); one entry
    for cp = 1."""
    grids = frame_grids(grids) if cp > 1 else grids
    shares = balance_images([t * h * w for t, h, w in grids], cp) if cp > 1 else [range(len(grids))]
    return tuple(
        count_flops(model, [], [grids[i] for i in share], freeze_vision=freeze_vision).vision
        for share in shares
    )


def row_flops(row: PackedRow, model, freeze_vision: bool = False) -> float:
    """Training FLOPs of one packed row: its real documents and images, not the padding."""
    cu = row.cu_seqlens[: row.num_samples + 1].tolist()
    docs = [b - a for a, b in zip(cu, cu[1:])]
    grids = row.image_grid_thw[: row.num_images]
    return count_flops(model, docs, grids, training=True, freeze_vision=freeze_vision).total
