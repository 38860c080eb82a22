"""Data configuration: plain dataclasses (Hydra registers them as schemas).

Defaults follow Qwen3-VL's preprocessor_config.json for everything that
changes the numbers the model sees (patch 16, merge 2, temporal 2, mean = std
= 0.5, min 256*256 pixels) except `max_pixels`: the reference allows
4096*4096 (65,536 patches, an inference setting); training defaults to
1024*1024 (4,096 patches) so one image always fits the default patch budget.

Every field is checked by `moevlm.data.loader.check_config` before any file is
read (a one-line message naming the field, its value and what to set).
`pack.max_patches: 0` is a text-only budget: samples with images are skipped as
`too_long` (or, with `oversize: truncate`, cut before their first image).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ImageConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 256 * 256
    max_pixels: int = 1024 * 1024
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_pixels: int = 100_000_000  # decompression-bomb guard: width*height of the encoded image
    jpeg_draft: bool = True  # let libjpeg decode at 1/2, 1/4, 1/8 scale when the target is that much smaller


@dataclass
class PackConfig:
    seq_len: int = 4096  # text tokens per micro-batch (one packed row)
    max_patches: int = 16384  # vision patches per micro-batch
    max_samples: int = 64  # documents per micro-batch (fixes the length of text cu_seqlens)
    max_images: int = 32  # images per micro-batch (fixes image_grid_thw / vision cu_seqlens)
    lookahead: int = 16  # at least this many samples to choose from (first fit) once they overflow a micro-batch
    oversize: str = "skip"  # a sample over a budget: "skip" (counted) or "truncate" (its text, images that no longer fit dropped)


@dataclass
class DataConfig:
    shards: str = ""  # a folder of *.tar, a brace pattern (dir/shard-{000000..000099}.tar) or a comma list
    # tokenizer.json; empty = <shards folder>/tokenizer.json, else <model.hf_checkpoint>/tokenizer.json
    tokenizer: str = ""
    image: ImageConfig = field(default_factory=ImageConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    num_workers: int = 2
    # logical data streams of the whole job (all ranks); the rows of a global batch depend only on this
    # (and the shards), not on the data-parallel size or num_workers.  A multiple of the data-parallel size.
    # 0 = auto = 16 (loader.DEFAULT_STREAMS): the same rows for dp 1, 2, 4, 8, 16.  Fewer shards than
    # streams: read as fewer streams (a divisor, logged); num_workers is lowered to fit (logged).
    streams: int = 0
    prefetch_factor: int = 2
    pin_memory: str = "auto"  # "auto" (when CUDA is available), "true", "false"
    start_method: str = "forkserver"  # fork is unsafe once CUDA is initialised (and with PIL + CUDA)
    seed: int = 0
    shuffle_shards: bool = True
    shuffle_buffer: int = 256  # samples; 0 keeps shard order
    epochs: int | None = None  # None: loop forever (the trainer counts steps)
    caption_prompt: str = ""  # user text placed after <image> for caption-only samples
    # resource caps per tar member, checked from the tar header before the bytes are read: a json/txt
    # member above max_text_bytes skips its sample as `text_too_large`, any other member above
    # max_image_bytes as `file_too_large` (1 MiB of text is ~250k tokens, far above any seq_len)
    max_text_bytes: int = 1048576  # 1 MiB
    max_image_bytes: int = 33554432  # 32 MiB
    # resume on shards whose size or content changed since the checkpoint (logged as a warning);
    # false: such a resume is refused, naming the changed shards
    allow_changed_shards: bool = False
