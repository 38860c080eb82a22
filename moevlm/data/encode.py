"""One raw WebDataset sample (member bytes) -> one model-ready `Sample`: byte caps, the record
(data.format), images decoded, tokens with the loss mask, 3-D M-RoPE positions.

Legend: L tokens of the sample, N its patches, D patch dim (3*T*P*P).

    enc = SampleEncoder(chat, image_cfg, pack_cfg, caption_prompt, mock, fmt)
    sample = enc(raw, pos)            # raises SkipSample(reason) for unusable input

A sample over a budget is `too_long`, or with pack.oversize=truncate cut before the first image that
no longer fits.  data.mock swaps only the image step (image_free, random_pixels).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from moevlm.data.config import ImageConfig, PackConfig
from moevlm.data.errors import SkipSample
from moevlm.data.image import decode_image, random_image
from moevlm.data.layouts import read_record
from moevlm.data.reader import Oversize, Pos
from moevlm.data.text import IGNORE_INDEX, IMAGE_PLACEHOLDER, ChatEncoder
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

    @property
    def tokens(self) -> int:
        return self.input_ids_L.numel()

    @property
    def patches(self) -> int:
        return 0 if self.pixels_ND is None else self.pixels_ND.shape[0]


class SampleEncoder:
    def __init__(
        self,
        chat: ChatEncoder,
        image: ImageConfig,
        pack: PackConfig,
        caption_prompt: str = "",
        mock: str = "none",
        fmt: str = "auto",
    ):
        self.chat, self.image, self.pack, self.caption_prompt = chat, image, pack, caption_prompt
        self.mock, self.fmt = mock, fmt
        self.merge = image.merge_size

    def __call__(self, raw: dict, pos: Pos) -> Sample:
        key = raw.get("__key__", "?")
        for m in raw.values():
            if isinstance(m, Oversize):
                raise SkipSample(
                    m.reason,
                    f"sample {key}: member {m.name} has {m.size} bytes, above the cap of "
                    f"{m.cap} (data.max_text_bytes / data.max_image_bytes)",
                )
        rec, unused = read_record(raw, self.fmt, self.caption_prompt)
        if self.mock == "image_free":
            rec, unused = _without_images(rec), []
        pixels, grids = self._images(raw, rec.images, rec.id)
        if rec.text is not None:
            ids, labels = self.chat.encode_text(rec.text)
        else:
            ids, labels = self.chat.encode_chat(
                rec.messages, [t * h * w // self.merge**2 for t, h, w in grids]
            )
        ids_L, labels_L = (
            torch.tensor(ids, dtype=torch.long),
            torch.tensor(labels, dtype=torch.long),
        )
        ids_L, labels_L, pixels, grids = self._fit(ids_L, labels_L, pixels, grids, rec.id)
        grid_I3 = torch.tensor(grids, dtype=torch.long).view(-1, 3)
        pos_3L = mrope_position_ids(ids_L[None], grid_I3, self.chat.image_pad_id, self.merge)[:, 0]
        return Sample(rec.id, pos, ids_L, labels_L, pos_3L, pixels, grids, unused)

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
    """data.mock=image_free: the record as text only (images and their <image> tags dropped)."""
    if rec.messages is None:
        return rec
    messages = [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, "")} for m in rec.messages]
    return dataclasses.replace(rec, images=[], messages=messages)
