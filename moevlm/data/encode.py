"""One raw WebDataset sample (member bytes) -> one model-ready `Sample`.

Legend: L tokens of the sample, N its patches, D patch dim (3*T*P*P).

    enc = SampleEncoder(tokenizer, image_cfg, pack_cfg, model_ids)
    sample = enc(raw, pos)            # raises SkipSample(reason) for unusable input

Design choices:
- Order: byte caps -> json -> record (normalized) -> images decoded -> tokens.  Images go
  first because the number of <|image_pad|> tokens is the image's merged grid.
- A member the reader did not read because it is over its byte cap (an
  `Oversize` marker, see reader.py) skips the sample first: `text_too_large`
  for json/txt, `file_too_large` for an image or any other file.
- Which record a sample holds (our json, or a third-party image-text layout:
  img2dataset, DataComp, image + txt) is data.format's business
  (layouts.py); image members the record does not use ride along as
  `Sample.unused` for the loader to count.
- A sample over a budget (seq_len tokens, max_patches patches, max_images
  images) is skipped as `too_long`, or with `oversize: truncate` cut: the text
  ends at seq_len or before the first image that no longer fits, whichever is
  first; images after the cut are dropped with their pixels.  A cut that leaves
  nothing to train on is `too_long` too.
- data.mock swaps only the image step: `image_free` drops a record's images
  and their <image> tags before tokenizing (a caption becomes a text-only
  chat: prompt and caption), `random_pixels` keeps each image's grid and
  tokens from its header but fills its patches with noise seeded by
  (sample id, member name), so two runs get the same values.
- 3-D M-RoPE positions are computed here, per sample, in the worker: the
  packer only concatenates them (they restart at every document anyway).
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
from moevlm.data.packing import IGNORE
from moevlm.data.reader import Oversize, Pos
from moevlm.data.text import IMAGE_PLACEHOLDER, ChatEncoder
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
        if not bool((labels_L != IGNORE).any()):
            raise SkipSample("too_long", what + "; nothing trainable is left after truncation")
        return ids_L, labels_L, (pixels[:used] if keep else None), grids[:keep]


def _without_images(rec):
    """data.mock=image_free: the record as text only (images and their <image> tags dropped)."""
    if rec.messages is None:
        return rec
    messages = [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, "")} for m in rec.messages]
    return dataclasses.replace(rec, images=[], messages=messages)
