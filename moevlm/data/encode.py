"""One raw WebDataset sample (member bytes) -> one model-ready `Sample`: byte caps, the record
(data.format), images and videos decoded (moevlm.data.encode_video), tokens with the loss mask,
3-D M-RoPE positions.

Legend: L tokens of the sample, N its patches, D patch dim (3*T*P*P).

    enc = SampleEncoder(chat, image_cfg, pack_cfg, caption_prompt, mock, fmt, video_cfg)
    sample = enc(raw, pos)            # raises SkipSample(reason) for unusable input

A sample over a budget is `too_long`, or with pack.oversize=truncate cut before the first image that
no longer fits.  A sample whose videos overflow the budgets first has them sampled down
(data.video.fit); one that still overflows is too_long (truncation cuts text and images only).
data.mock swaps only the image and video step (image_free, random_pixels).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from moevlm.data.config import ImageConfig, PackConfig, VideoConfig
from moevlm.data.encode_video import VideoPlan, cat_pixels, probe_plan, video_patches
from moevlm.data.errors import SkipSample
from moevlm.data.image import decode_image, random_image
from moevlm.data.layouts import read_record
from moevlm.data.reader import Oversize, Pos
from moevlm.data.text import IGNORE_INDEX, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, ChatEncoder
from moevlm.model.rope import mrope_position_ids


@dataclass
class Sample:
    """One encoded sample, what the packer places: L tokens, N patches of the images in `grids`."""

    id: str
    pos: Pos
    input_ids_L: torch.Tensor
    labels_L: torch.Tensor
    position_ids_3L: torch.Tensor
    pixels_ND: torch.Tensor | None
    grids: list[tuple[int, int, int]]
    unused: list[str] = dataclasses.field(default_factory=list)  # image members not trained on
    video_pixels_ND: torch.Tensor | None = None  # the videos' patches, grids in `video_grids`
    video_grids: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # counted choices (FALLBACKS)

    @property
    def tokens(self) -> int:
        return self.input_ids_L.numel()

    @property
    def patches(self) -> int:
        return 0 if self.pixels_ND is None else self.pixels_ND.shape[0]

    @property
    def video_patches(self) -> int:
        return 0 if self.video_pixels_ND is None else self.video_pixels_ND.shape[0]


class SampleEncoder:
    def __init__(
        self,
        chat: ChatEncoder,
        image: ImageConfig,
        pack: PackConfig,
        caption_prompt: str = "",
        mock: str = "none",
        fmt: str = "auto",
        video: VideoConfig | None = None,
    ):
        self.chat, self.image, self.pack, self.caption_prompt = chat, image, pack, caption_prompt
        self.mock, self.fmt = mock, fmt
        self.video = video if video is not None else VideoConfig()
        self.merge = image.merge_size

    def __call__(self, raw: dict, pos: Pos) -> Sample:
        key = raw.get("__key__", "?")
        for m in raw.values():
            if isinstance(m, Oversize):
                raise SkipSample(
                    m.reason,
                    f"sample {key}: member {m.name} has {m.size} bytes, above the cap of "
                    f"{m.cap} (data.max_text_bytes / data.max_image_bytes / data.max_video_bytes)",
                )
        rec, unused = read_record(raw, self.fmt, self.caption_prompt)
        if self.mock == "image_free":
            rec, unused = _without_images(rec), []
        pixels, grids = self._images(raw, rec.images, rec.id)
        plans = self._plan_videos(raw, rec.videos, rec.id)
        if rec.text is not None:
            ids, labels = self.chat.encode_text(rec.text)
        else:
            ids, labels, plans = self._encode_chat(rec.messages, grids, plans)
        ids_L, labels_L = (
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(labels, dtype=torch.long),
        )
        loaded = [self._load_video(raw[p.name], p, rec.id) for p in plans]
        vgrids = [g for _, g in loaded]
        if vgrids:
            self._fit_videos(ids_L, grids, vgrids, rec.id)
        ids_L, labels_L, pixels, grids = self._fit(ids_L, labels_L, pixels, grids, rec.id)
        grid_I3 = torch.tensor(grids, dtype=torch.long).view(-1, 3)
        vgrid_V3 = torch.tensor(vgrids, dtype=torch.long).view(-1, 3)
        pos_3L = mrope_position_ids(
            ids_L[None],
            grid_I3,
            self.chat.image_pad_id,
            self.merge,
            video_grid_thw_V3=vgrid_V3,
            video_token_id=self.chat.video_pad_id,
        )[:, 0]
        fallbacks = [c for p in plans for c in p.choices]
        return Sample(
            rec.id,
            pos,
            ids_L,
            labels_L,
            pos_3L,
            pixels,
            grids,
            unused,
            cat_pixels([px for px, _ in loaded]),
            vgrids,
            fallbacks,
        )

    # ------------------------------------------------------------------ videos
    def _plan_videos(self, raw: dict, names: list[str], sid: str) -> list[VideoPlan]:
        if names and self.pack.max_videos < len(names):
            raise SkipSample(
                "too_long" if self.pack.max_videos else "videos_off",
                f"{sid}: {len(names)} video(s), data.pack.max_videos={self.pack.max_videos}",
            )
        plans = []
        for name in names:
            if raw.get(name) is None:
                raise SkipSample(
                    "missing_video", f"{sid}: member {name!r} is not in the sample ({sorted(raw)})"
                )
            plans.append(probe_plan(raw[name], name, self.video))
        return plans

    def _encode_chat(self, messages, grids, plans: list[VideoPlan]):
        """(ids, labels, plans): the conversation encoded, its videos sampled down (data.video.fit)
        until the sample fits the token and video-patch budgets, or they can shrink no further."""
        p, v = self.pack, self.video
        image_tokens = [t * h * w // self.merge**2 for t, h, w in grids]
        for _ in range(32):
            spans = [x.span(v) for x in plans]
            ids, labels = self.chat.encode_chat(messages, image_tokens, videos=spans)
            if not plans or v.fit == "skip":
                return ids, labels, plans
            patches = video_patches(plans, v)
            vtokens = sum(len(s.seconds) * (s.frame_tokens + 2) for s in spans)
            over_tokens = len(ids) - p.seq_len
            ratio = min(
                1.0,
                p.max_video_patches / patches,
                (vtokens - over_tokens) / vtokens if over_tokens > 0 else 1.0,
            )
            if ratio >= 1.0:
                return ids, labels, plans
            shrunk = [x.shrunk(max(ratio, 0.01) * 0.97, v) for x in plans]
            if shrunk == plans:
                return ids, labels, plans  # as small as it gets: _fit_videos says too_long
            plans = shrunk
        return ids, labels, plans

    def _load_video(self, data, plan: VideoPlan, sid: str):
        seed = zlib.crc32(f"{sid}/{plan.name}".encode()) if self.mock == "random_pixels" else None
        pixels, grid, _ = plan.load(bytes(data), self.video, seed)
        return pixels, grid

    def _fit_videos(self, ids_L, grids, vgrids, sid: str) -> None:
        """A sample with videos over a budget after sampling down is too_long (never cut mid-video)."""
        p = self.pack
        n = sum(t * h * w for t, h, w in vgrids)
        images_over = (
            sum(t * h * w for t, h, w in grids) > p.max_patches or len(grids) > p.max_images
        )
        if n > p.max_video_patches or ids_L.numel() > p.seq_len or images_over:
            raise SkipSample(
                "too_long",
                f"{sid}: {ids_L.numel()} tokens, {n} video patches in {len(vgrids)} video(s), sampled "
                f"down as far as data.video.fit={self.video.fit} goes, against seq_len={p.seq_len}, "
                f"max_video_patches={p.max_video_patches}",
            )

    def _images(self, raw: dict, names: list[str], sid: str):
        out, grids = [], []
        for name in names:
            data = raw.get(name)
            if data is None:
                raise SkipSample(
                    "missing_image", f"{sid}: member {name!r} is not in the sample ({sorted(raw)})"
                )
            if self.mock == "random_pixels":
                pixels, grid = random_image(data, self.image, zlib.crc32(f"{sid}/{name}".encode()))
            else:
                pixels, grid = decode_image(data, self.image)
            out.append(pixels)
            grids.append(tuple(grid))
        return (torch.cat(out) if out else None), grids

    def _fit(self, ids_L, labels_L, pixels, grids, sid: str):
        p = self.pack
        patches = [t * h * w for t, h, w in grids]
        if (
            ids_L.numel() <= p.seq_len
            and sum(patches) <= p.max_patches
            and len(grids) <= p.max_images
        ):
            return ids_L, labels_L, pixels, grids
        what = (
            f"{sid}: {ids_L.numel()} tokens, {sum(patches)} patches, {len(grids)} images against budgets "
            f"seq_len={p.seq_len}, max_patches={p.max_patches}, max_images={p.max_images}"
        )
        if p.oversize != "truncate":
            raise SkipSample("too_long", what + " (pack.oversize=truncate cuts instead)")
        starts = (ids_L == self.chat.vision_start_id).nonzero().squeeze(-1).tolist()
        cut, keep, used = p.seq_len, 0, 0
        for i, (start, n) in enumerate(zip(starts, patches)):
            end = start + 2 + n // self.merge**2  # vision_start, pads, vision_end
            if end > p.seq_len or used + n > p.max_patches or i >= p.max_images:
                cut = min(cut, start)
                break
            keep, used = i + 1, used + n
        ids_L, labels_L = ids_L[:cut], labels_L[:cut]
        if not bool((labels_L != IGNORE_INDEX).any()):
            raise SkipSample("too_long", what + "; nothing trainable is left after truncation")
        return ids_L, labels_L, (pixels[:used] if keep else None), grids[:keep]


def _without_images(rec):
    """data.mock=image_free: the record as text only (images, videos and their tags dropped)."""
    if rec.messages is None:
        return rec
    messages = [
        {**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, "").replace(VIDEO_PLACEHOLDER, "")}
        for m in rec.messages
    ]
    return dataclasses.replace(rec, images=[], videos=[], messages=messages)
