"""The data configuration: plain dataclasses (Hydra registers them as schemas), each field with its
help text (`python train.py --help`, docs/configuration.md), and the allowed values of the string fields.
The checks of these fields sit beside them, in moevlm.data.checks.

    DataConfig(shards=..., image=ImageConfig(...), pack=PackConfig(...), num_workers=2, streams=0)
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass, field

from moevlm.fields import one_of

# allowed values, checked by moevlm.data.checks.check_fields and listed by `python train.py --help`
OVERSIZE = ("skip", "truncate")
PIN_MEMORY = ("auto", "true", "false")
VIDEO_FIT = ("frames", "resolution", "skip")
MOCK = ("none", "image_free", "random_pixels")
FORMATS = ("auto", "moevlm", "image_caption")
START_METHODS = tuple(sorted(mp.get_all_start_methods()))  # data.start_method: this platform's
# data.streams=0 (auto): the same rows for dp in {1, 2, 4, 8, 16}, any num_workers
DEFAULT_STREAMS = 16


@dataclass
class ImageConfig:
    """Image preprocessing: patch geometry, resize bounds, normalization, decode guards."""

    patch_size: int = field(default=16, metadata={"help": "vision patch side in pixels"})
    temporal_patch_size: int = field(
        default=2, metadata={"help": "frames per patch (a still image is repeated to fill them)"}
    )
    merge_size: int = field(
        default=2,
        metadata={
            "help": "merge_size x merge_size patches become one text-width token; image sides are multiples of "
            "patch_size x merge_size"
        },
    )
    min_pixels: int = field(
        default=256 * 256, metadata={"help": "smaller images are upscaled to at least this area"}
    )
    max_pixels: int = field(
        default=1024 * 1024,
        metadata={
            "help": "larger images are downscaled to at most this area (Qwen3-VL's reference allows 4096*4096)"
        },
    )
    mean: tuple[float, float, float] = field(
        default=(0.5, 0.5, 0.5),
        metadata={"help": "per-channel (R, G, B) mean subtracted from pixels in [0, 1]"},
    )
    std: tuple[float, float, float] = field(
        default=(0.5, 0.5, 0.5),
        metadata={"help": "per-channel (R, G, B) std pixels are divided by, each > 0"},
    )
    max_image_pixels: int = field(
        default=100_000_000,
        metadata={
            "help": "decompression-bomb guard: width*height of the encoded image; larger ones are skipped"
        },
    )
    max_decode_bytes: int = field(
        default=400_000_000,
        metadata={
            "help": "decode memory guard: bytes an image holds while decoded and converted, from its header "
            "(width*height times bytes per pixel of its mode: 4 for 8-bit RGB, about 36 for 16-bit grey); "
            "larger ones are skipped (the default passes any 8-bit RGB image within max_image_pixels)"
        },
    )
    jpeg_draft: bool = field(
        default=True,
        metadata={
            "help": "let libjpeg decode at 1/2, 1/4, 1/8 scale when the target is that much smaller"
        },
    )


@dataclass
class VideoDecodeConfig:
    """Video decode guards (checked on the header, before any frame is decoded) and the per-sample
    budget; over any of them a video is skipped by its reason (moevlm.data.video_decode)."""

    max_frame_pixels: int = field(
        default=8192 * 8192, metadata={"help": "width*height of one frame; above: video_too_large"}
    )
    max_decode_bytes: int = field(
        default=400_000_000,
        metadata={
            "help": "bytes of the decoded frames a sample uses (frames x width x height x 3); above: "
            "video_too_large"
        },
    )
    max_frames: int = field(
        default=1 << 20,
        metadata={
            "help": "the header's frame count (about 9.7 h at 30 fps); above: video_too_long"
        },
    )
    max_duration_s: float = field(
        default=4 * 3600.0,
        metadata={"help": "the header's duration in seconds; above: video_too_long"},
    )
    max_decoded_frames: int = field(
        default=4096,
        metadata={
            "help": "frames decoded for one video, the used ones included (seeking keeps it low); above: "
            "video_decode_budget"
        },
    )
    max_decode_s: float | None = field(
        default=None,
        metadata={
            "help": "wall-clock seconds to decode one video; null = off (a skip would then depend on the "
            "machine)"
        },
    )
    threads: int = field(
        default=1,
        metadata={"help": "decoder threads per video (the loader's workers are the parallelism)"},
    )
    end_slack_s: float = field(
        default=0.5,
        metadata={
            "help": "a wanted frame at most this far past the stream's real end gets its last frame (the "
            "count mkv/webm headers give may overshoot by a frame)"
        },
    )


@dataclass
class VideoConfig:
    """Video frame sampling and preprocessing, named as transformers' Qwen3VLVideoProcessor names them
    (min_pixels/max_pixels are its size["shortest_edge"]/size["longest_edge"]: pixels of all frames)."""

    fps: float = field(default=2.0, metadata={"help": "frames sampled per second of video"})
    min_frames: int = field(default=4, metadata={"help": "fewest frames sampled from a video"})
    max_frames: int = field(default=768, metadata={"help": "most frames sampled from a video"})
    min_pixels: int = field(
        default=128 * 32 * 32,
        metadata={
            "help": "smaller videos are upscaled to at least this many pixels, all frames together"
        },
    )
    max_pixels: int = field(
        default=768 * 32 * 32,
        metadata={
            "help": "larger videos are downscaled to at most this many pixels, all frames together"
        },
    )
    cap_pixels_per_frame: bool = field(
        default=True,
        metadata={
            "help": "each frame's pixels at most max_video_tokens merged patches and max_pixels / frames "
            "(qwen-vl-utils' rule; transformers' coming default)"
        },
    )
    max_video_tokens: int = field(
        default=768,
        metadata={"help": "per-frame ceiling of cap_pixels_per_frame, in merged patches"},
    )
    patch_size: int = field(default=16, metadata={"help": "vision patch side in pixels"})
    temporal_patch_size: int = field(
        default=2, metadata={"help": "frames per patch (an odd last frame is repeated)"}
    )
    merge_size: int = field(
        default=2, metadata={"help": "merge_size x merge_size patches become one text-width token"}
    )
    mean: tuple[float, float, float] = field(
        default=(0.5, 0.5, 0.5),
        metadata={"help": "per-channel (R, G, B) mean subtracted from pixels in [0, 1]"},
    )
    std: tuple[float, float, float] = field(
        default=(0.5, 0.5, 0.5),
        metadata={"help": "per-channel (R, G, B) std pixels are divided by, each > 0"},
    )
    fit: one_of(*VIDEO_FIT, checked_by="moevlm.data.checks.check_fields") = field(
        default="frames",
        metadata={
            "help": "a sample whose videos overflow a row's patch or token budget: frames (fewer frames "
            "first, down to temporal_patch_size, then lower resolution), resolution (lower resolution first, "
            "down to one merge block a side, then fewer frames), skip (as data.pack.oversize says); each "
            "video sampled down is counted (video_fewer_frames, video_lower_resolution)"
        },
    )
    decode: VideoDecodeConfig = field(default_factory=VideoDecodeConfig)


@dataclass
class PackConfig:
    """Packing budgets per micro-batch row: fixed, so every tensor shape is static."""

    seq_len: int = field(
        default=4096, metadata={"help": "text tokens per micro-batch (one packed row)"}
    )
    max_patches: int = field(
        default=16384,
        metadata={
            "help": "vision patches per micro-batch; 0 = text only (samples with images skipped or truncated)"
        },
    )
    max_samples: int = field(
        default=64,
        metadata={"help": "documents per micro-batch (fixes the length of the text cu_seqlens)"},
    )
    max_images: int = field(
        default=32,
        metadata={
            "help": "images per micro-batch (fixes image_grid_thw and the vision cu_seqlens)"
        },
    )
    max_videos: int = field(
        default=0,
        metadata={
            "help": "videos per micro-batch (fixes video_grid_thw); 0 = rows carry no video (a sample with one is "
            "skipped as videos_off)"
        },
    )
    max_video_patches: int = field(
        default=16384,
        metadata={
            "help": "video patches per micro-batch (fixes pixel_values_videos; beside max_patches, which counts "
            "image patches); a longer video is sampled down (data.video.fit)"
        },
    )
    lookahead: int = field(
        default=16,
        metadata={
            "help": "at least this many samples to choose from (first fit) once they overflow a micro-batch"
        },
    )
    max_vision_flops: str = field(
        default="off",
        metadata={
            "help": "vision balance: a bound on the vision tower's forward FLOPs per packed row (the model's "
            "formula, attention's quadratic term per image included; moevlm.data.packing): off, auto (halfway "
            "between a full row of images too small for attention to count and a full row of images of "
            "data.image.max_pixels), or a number of FLOPs; a row closes when it is reached and first fit "
            "fills toward it; a sample over it alone goes alone in its row (counted)"
        },
    )
    oversize: one_of(*OVERSIZE, checked_by="moevlm.data.checks.check_fields") = field(
        default="skip",
        metadata={
            "help": "a sample over a budget: skip (counted) or truncate (its text cut, images that no longer fit "
            "dropped)"
        },
    )


@dataclass
class DataConfig:
    """The data: WebDataset shards, tokenizer, image preprocessing, packing, the loader's workers and limits."""

    shards: str = field(
        default="",
        metadata={
            "help": "WebDataset shards: a folder of *.tar, a brace pattern (dir/shard-{000000..000099}.tar), a comma "
            "list, or sample (the embedded set); build them with python -m moevlm.data.build_shards; or what "
            "Hugging Face datasets saves (a Parquet file or folder, a save_to_disk or DatasetDict folder), "
            "converted once into shards in the cache ($MOEVLM_CACHE) and reused"
        },
    )
    split: str = field(
        default="",
        metadata={
            "help": "the split read when data.shards (or val_shards) is a DatasetDict folder or a Parquet folder "
            "named by split; empty = train, or the only split"
        },
    )
    format: one_of(*FORMATS, checked_by="moevlm.data.checks.check_fields") = field(
        default="auto",
        metadata={
            "help": "how a shard's samples are read: moevlm (a json record naming its image members, as "
            "build_shards writes), image_caption (third-party image-text shards: img2dataset / LAION / CC3M / "
            "COYO, DataComp, plain image + txt; the first image member with the caption from txt, else the "
            "json's caption, else its text; the json is otherwise metadata), auto (moevlm when the json names "
            "images or the sample has no image member, else image_caption)"
        },
    )
    val_shards: str = field(
        default="",
        metadata={
            "help": "held-out shards for train.val_every, in the forms of data.shards (sample included), read with "
            "the training run's tokenizer and settings; empty = no validation"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "a tokenizer.json; empty = <shards folder>/tokenizer.json, else <model.hf_checkpoint>/tokenizer.json, "
            "else (no checkpoint, a model the tiny ids fit) the sample set's"
        },
    )
    image: ImageConfig = field(default_factory=ImageConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    num_workers: int = field(
        default=2, metadata={"help": "loader worker processes per rank; 0 = in the trainer"}
    )
    streams: int = field(
        default=0,
        metadata={
            "help": "logical data streams of the whole job: the rows of a global batch depend only on this (and the "
            "shards), not on dp or num_workers; a multiple of dp; 0 = auto = 16, the same rows for dp 1, 2, 4, "
            "8, 16; fewer shards than streams: read as fewer streams (a divisor, logged); num_workers is "
            "lowered to fit (logged)"
        },
    )
    prefetch_factor: int = field(default=2, metadata={"help": "rows each worker prepares ahead"})
    pin_memory: one_of(*PIN_MEMORY, checked_by="moevlm.data.checks.check_fields") = field(
        default="auto",
        metadata={
            "help": "page-locked batches for faster host-to-GPU copies: auto (when CUDA is available), true, false"
        },
    )
    start_method: one_of(*START_METHODS, checked_by="moevlm.data.checks.check_fields") = field(
        default="forkserver",
        metadata={
            "help": "how workers start; fork is unsafe once CUDA is initialized (and with PIL + CUDA)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the shard and sample shuffles"})
    shuffle_shards: bool = field(
        default=True, metadata={"help": "shuffle the shard order each epoch"}
    )
    shuffle_buffer: int = field(
        default=256, metadata={"help": "samples in the shuffle buffer; 0 keeps shard order"}
    )
    epochs: int | None = field(
        default=None,
        metadata={"help": "passes over the shards; null = loop forever (the trainer counts steps)"},
    )
    caption_prompt: str = field(
        default="", metadata={"help": "user text placed after <image> for caption-only samples"}
    )
    max_text_bytes: int = field(
        default=1048576,
        metadata={
            "help": "a json/txt tar member above this many bytes skips its sample as text_too_large (checked from "
            "the tar header; 1 MiB is ~250k tokens)"
        },
    )
    max_image_bytes: int = field(
        default=33554432,
        metadata={
            "help": "any other tar member (an image) above this many bytes skips its sample as file_too_large "
            "(32 MiB)"
        },
    )
    max_video_bytes: int = field(
        default=268435456,
        metadata={
            "help": "a video tar member (mp4, mov, mkv, webm, avi) above this many bytes skips its sample as "
            "file_too_large (256 MiB, as build_shards' --max-video-bytes)"
        },
    )
    allow_changed_shards: bool = field(
        default=False,
        metadata={
            "help": "resume on shards whose size or content changed since the checkpoint (logged as a warning; "
            "samples the checkpoint held that a shard no longer has are skipped, counted as gone_on_resume); "
            "false: such a resume is refused, naming the changed shards"
        },
    )
    mock: one_of(*MOCK, checked_by="moevlm.data.checks.check_fields") = field(
        default="none",
        metadata={
            "help": "mock data for measuring, same loader path and batch shapes: none (real), image_free (images and "
            "their tokens dropped: text only), random_pixels (each image's real size, grid and tokens, but "
            "seeded uniform random pixels instead of the decoded ones); part of the data identity: a resume "
            "with another value is refused"
        },
    )
