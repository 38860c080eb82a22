"""Data configuration: plain dataclasses (Hydra registers them as schemas).

Defaults follow Qwen3-VL's preprocessor_config.json for everything that
changes the numbers the model sees (patch 16, merge 2, temporal 2, mean = std
= 0.5, min 256*256 pixels) except `max_pixels`: the reference allows
4096*4096 (65,536 patches, an inference setting); training defaults to
1024*1024 (4,096 patches) so one image always fits the default patch budget.

Every field carries its description (`metadata={"help": ...}`, shown by `python train.py --help`
and conf/README.md: moevlm.train.options) and is checked by `moevlm.data.loader.check_config` before any file is
read (a one-line message naming the field, its value and what to set).  What a job asks of its data
beyond that (shards named and present, the tokenizer fitting the model, the packed row cut evenly by the
layout) is checked here, below the dataclasses, for moevlm.train.validate.
`mock` (moevlm.data.encode) swaps only the image step, so a measurement on
mock data runs the same reader, workers, tokenizer and packer as real data.
`pack.max_patches: 0` is a text-only budget: samples with images are skipped as
`too_long` (or, with `oversize: truncate`, cut before their first image).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from omegaconf import MISSING

from moevlm.errors import check

# allowed values, checked by moevlm.data.loader.check_fields and listed by `python train.py --help`
OVERSIZE = ("skip", "truncate")
PIN_MEMORY = ("auto", "true", "false")
MOCK = ("none", "image_free", "random_pixels")
FORMATS = ("auto", "moevlm", "image_caption")


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
    oversize: str = field(
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
            "list, or sample (the embedded set); build them with python -m moevlm.data.build_shards"
        },
    )
    format: str = field(
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
            "help": "a tokenizer.json; empty = <shards folder>/tokenizer.json, else <model.hf_checkpoint>/tokenizer.json"
        },
    )
    image: ImageConfig = field(default_factory=ImageConfig)
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
    pin_memory: str = field(
        default="auto",
        metadata={
            "help": "page-locked batches for faster host-to-GPU copies: auto (when CUDA is available), true, false"
        },
    )
    start_method: str = field(
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
            "help": "any other tar member above this many bytes skips its sample as file_too_large (32 MiB)"
        },
    )
    allow_changed_shards: bool = field(
        default=False,
        metadata={
            "help": "resume on shards whose size or content changed since the checkpoint (logged as a warning); "
            "false: such a resume is refused, naming the changed shards"
        },
    )
    mock: str = field(
        default="none",
        metadata={
            "help": "mock data for measuring, same loader path and batch shapes: none (real), image_free (images and "
            "their tokens dropped: text only), random_pixels (each image's real size, grid and tokens, but "
            "seeded uniform random pixels instead of the decoded ones); part of the data identity: a resume "
            "with another value is refused"
        },
    )


# ------------------------------------------------------------------ job checks
def check_job_data(d: DataConfig, model, dp: int = 1, tp: int = 1, cp: int = 1) -> None:
    """The data as the job uses it: shards named, each field in range and the image geometry the
    model's (moevlm.data.loader.check_config), the packed row within the model's positions and cut
    evenly by the layout's dp x cp x tp.  ValueError (moevlm.train.validate reports it) on the first."""
    from moevlm.data.loader import check_config

    check(
        d.shards not in ("", MISSING),
        "data.shards is not set: point it at WebDataset shards (a folder, a brace pattern or a list; build them "
        "with python -m moevlm.data.build_shards) or use data.shards=sample for the embedded sample set",
        ValueError,
    )
    check_config(d, model, dp)
    pk = d.pack
    check(
        pk.seq_len <= model.text.max_position_embeddings,
        f"data.pack.seq_len={pk.seq_len} exceeds the model's max_position_embeddings="
        f"{model.text.max_position_embeddings}",
        ValueError,
    )
    if cp == 1:
        check(
            pk.seq_len % tp == 0,
            f"data.pack.seq_len={pk.seq_len} must be divisible by tp={tp} (sequence parallel)",
            ValueError,
        )
    else:
        check(
            pk.seq_len % (2 * cp) == 0 and (pk.seq_len // cp) % tp == 0,
            f"data.pack.seq_len={pk.seq_len} must be divisible by 2*cp={2 * cp} (each row is cut into 2*cp "
            f"chunks for load-balanced context parallel) and seq_len/cp by tp={tp} (sequence parallel): "
            f"use a multiple of {math.lcm(2 * cp, cp * tp)}",
            ValueError,
        )


def check_stream_layout(d: DataConfig, dp: int) -> None:
    """data.shards and data.val_shards can feed `dp` data-parallel ranks: the loader's own rule
    (loader.resolve_streams), applied here, on every rank, before anything is built.  At loader build
    it would come too late on a pipeline: only the first stage's ranks build a loader, and the other
    stages would wait for them until the collective timeout."""
    from moevlm.data.loader import log, resolve_streams
    from moevlm.data.reader import expand_shards

    for key, spec in (("data.shards", d.shards), ("data.val_shards", d.val_shards)):
        if spec in ("", "sample", MISSING) or not isinstance(spec, str):
            continue
        try:
            shards = expand_shards(spec)
        except ValueError:
            # a spec that names nothing: check_shards says so, in its own words
            continue
        # the loader logs the same reductions when it is built: said once
        was, log.disabled = log.disabled, True
        try:
            resolve_streams(d, 0, dp, len(shards))
        except ValueError as err:
            raise ValueError(str(err) if key == "data.shards" else f"{key}: {err}") from None
        finally:
            log.disabled = was


def check_tokenizer(data: DataConfig, hf_checkpoint: str, model) -> None:
    """The data's tokenizer is found (data.tokenizer, beside the shards, or the HF checkpoint's; the sample
    set's own, which it builds later with TINY_SPECIAL_IDS) and its special tokens sit where the model
    expects them: ValueError, one line saying which keys fix it."""
    from moevlm.data.text import TINY_SPECIAL_IDS, model_mismatches

    if data.shards in ("", MISSING):
        return
    if data.shards == "sample" and not data.tokenizer:
        ids, vocab = TINY_SPECIAL_IDS, max(TINY_SPECIAL_IDS.values()) + 1
        source = "the sample set's tokenizer (data.shards=sample: a small BPE for the tiny model)"
    else:
        path = _find_tokenizer(data, hf_checkpoint)
        if path is None:
            return  # check_shards says why the shards cannot be read
        ids, vocab = _tokenizer_ids(path)
        source = f"the tokenizer {os.path.abspath(path)}"
    wrong = model_mismatches(ids, vocab, model)
    if not wrong:
        return
    vocab_wrong = wrong.pop("text.vocab_size", None)
    found = [
        f"{name} is {want} there but {have} in the model" for name, (want, have) in wrong.items()
    ]
    if vocab_wrong:
        found.append(f"it has {vocab_wrong[0]} ids but the model's vocabulary {vocab_wrong[1]}")
    if hf_checkpoint:
        ckpt = os.path.join(os.path.abspath(hf_checkpoint), "tokenizer.json")
        fix = "the checkpoint's weights are trained for its own ids: use its tokenizer " + (
            f"(data.tokenizer={ckpt})" if os.path.isfile(ckpt) else "(data.tokenizer=FILE)"
        )
    else:
        keys = [f"model.{name}={want}" for name, (want, _) in wrong.items()]
        keys += [f"model.vocab_size={vocab_wrong[0]}"] if vocab_wrong else []
        fix = (
            f"a randomly initialized model can take the tokenizer's: {' '.join(keys)}; or give the "
            "model's own tokenizer (data.tokenizer=FILE)"
        )
    raise ValueError(f"{source} does not fit the model: {', '.join(found)}; {fix}")


def _find_tokenizer(data: DataConfig, hf_checkpoint: str) -> str | None:
    """The tokenizer.json the loader will use; None when the shards cannot be listed (reported elsewhere).
    DataSetupError (a ConfigError) names the three places when there is none."""
    from moevlm.data.loader import find_tokenizer
    from moevlm.data.reader import expand_shards

    if data.tokenizer or data.shards == "sample":
        return find_tokenizer(data, [], hf_checkpoint)
    try:
        shards = expand_shards(data.shards)
    except FileNotFoundError:
        return None
    return find_tokenizer(data, shards, hf_checkpoint)


def _tokenizer_ids(path: str) -> tuple[dict[str, int], int]:
    """(special token -> id, number of ids) of the tokenizer.json at `path`."""
    from moevlm.data.text import ChatEncoder, load_tokenizer

    try:
        enc = ChatEncoder(load_tokenizer(path))
    except Exception as err:  # noqa: BLE001  (not a usable tokenizer.json at all)
        raise ValueError(
            f"the tokenizer {os.path.abspath(path)} cannot be loaded ({type(err).__name__}: "
            f"{' '.join(str(err).split())}); point data.tokenizer at a tokenizers tokenizer.json"
        ) from None
    return enc.special_ids, enc.vocab_size


def shown_path(path: str) -> str:
    """`path` as typed, and where it resolves when it is relative: `ckpt (= /work/ckpt)`."""
    path = str(path)
    return path if os.path.isabs(path) else f"{path} (= {os.path.abspath(path)})"


def check_shards(spec: str) -> None:
    """A shard spec that names nothing readable (the sample set and the empty value are checked elsewhere)."""
    if spec in ("", "sample", MISSING) or not isinstance(spec, str):
        return
    if (
        "{" not in spec
        and "," not in spec
        and not any(c in spec for c in "*?[")
        and not os.path.exists(spec)
    ):
        raise ValueError(
            f"data.shards={shown_path(spec)} does not exist; give a folder of .tar shards (build them with "
            "python -m moevlm.data.build_shards), a brace pattern or a list"
        )
    from moevlm.data.reader import expand_shards

    shards = expand_shards(spec)  # naming nothing that exists: DataSetupError
    missing = [s for s in shards if not os.path.isfile(s)]
    check(
        not missing,
        f"data.shards={spec} names {len(missing)} shard(s) that do not exist, e.g. {missing[:3]}",
        ValueError,
    )
