"""The data config's checks: each field on its own, against the model and the layout, and what a job
asks of its data (shards named and present, a tokenizer that fits the model, a packed row the layout
cuts evenly), all before any file is decoded.  Each raises ValueError with one line naming the field,
its value and what to set (DataSetupError where a file is missing).

    check_config(cfg, model_cfg, dp)         # no file read: fields, image geometry, budgets, streams
    L, workers = resolve_streams(cfg, rank, dp, num_shards)   # the stream layout, fitted to the shards
    check_job_data(cfg, model_cfg, dp, tp, cp)  # + the row against the model's positions and the layout
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os

from omegaconf import MISSING

from moevlm.data.config import (
    DEFAULT_STREAMS,
    FORMATS,
    MOCK,
    OVERSIZE,
    PIN_MEMORY,
    VIDEO_FIT,
    DataConfig,
)
from moevlm.data.errors import DataSetupError
from moevlm.data.hf_datasets import is_dataset, open_dataset
from moevlm.data.packing import vision_budget
from moevlm.data.reader import expand_shards
from moevlm.data.text import TINY_SPECIAL_IDS, ChatEncoder, load_tokenizer, model_mismatches
from moevlm.errors import check

# the stream layout's warnings are the loader's (one logger for all of its parts)
log = logging.getLogger("moevlm.data.loader")


def check_config(cfg: DataConfig, model_cfg=None, world: int = 1) -> None:
    """Every check that needs no file: each field's range, image geometry against the model, budgets,
    the streams' layout."""
    check_fields(cfg)
    im, pk = cfg.image, cfg.pack
    if model_cfg is not None:
        v = model_cfg.vision
        mine = (im.patch_size, im.temporal_patch_size, im.merge_size)
        theirs = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        if mine != theirs:
            raise ValueError(
                f"data.image (patch, temporal, merge) = {mine} but the model's vision config has "
                f"{theirs}; set data.image to the model's values"
            )
    unit = im.patch_size**2
    # 0: a text-only budget
    if pk.max_patches and pk.max_images and im.max_pixels // unit > pk.max_patches:
        raise ValueError(
            f"one image may need up to {im.max_pixels // unit} patches (data.image.max_pixels="
            f"{im.max_pixels}) but a micro-batch holds data.pack.max_patches={pk.max_patches}; "
            "raise max_patches or lower max_pixels (or set max_patches=0 to train on text only)"
        )
    if pk.max_patches % im.merge_size**2:
        raise ValueError(
            f"data.pack.max_patches={pk.max_patches} must be a multiple of merge_size^2="
            f"{im.merge_size**2} (the padding patches are merged like an image's)"
        )
    check_streams(cfg, world)


def _require(ok: bool, field: str, value, want: str) -> None:
    if not ok:
        raise ValueError(f"data.{field}={value!r} is invalid: set it to {want}")


def _check_normalisation(section: str, c) -> None:
    """data.image's or data.video's per-channel mean and std."""
    _require(
        len(c.mean) == 3, f"{section}.mean", list(c.mean), "three per-channel values (R, G, B)"
    )
    _require(
        len(c.std) == 3 and all(x > 0 for x in c.std),
        f"{section}.std",
        list(c.std),
        "three positive per-channel values (pixels are divided by them)",
    )


def _one_of(values) -> str:
    *head, last = map(repr, values)
    return f"{', '.join(head)} or {last}" if head else last


def check_video(cfg: DataConfig) -> None:
    """data.video and data.max_video_bytes: positive sizes, frame bounds in order, the patch geometry
    of data.image (one vision tower reads both)."""
    v, im, d = cfg.video, cfg.image, cfg.video.decode
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        want = getattr(im, name)
        _require(
            getattr(v, name) == want, f"video.{name}", getattr(v, name), f"data.image.{name}={want}"
        )
    _require(v.fps > 0, "video.fps", v.fps, "a positive frame rate")
    _require(
        v.temporal_patch_size <= v.min_frames <= v.max_frames,
        "video.min_frames",
        v.min_frames,
        f"at least temporal_patch_size={v.temporal_patch_size} and at most video.max_frames={v.max_frames}",
    )
    _require(
        1 <= v.min_pixels <= v.max_pixels,
        "video.min_pixels",
        v.min_pixels,
        f"a positive pixel count at most video.max_pixels={v.max_pixels}",
    )
    _require(v.max_video_tokens >= 1, "video.max_video_tokens", v.max_video_tokens, "at least 1")
    _require(v.fit in VIDEO_FIT, "video.fit", v.fit, _one_of(VIDEO_FIT))
    _check_normalisation("video", v)
    for name in (
        "max_frame_pixels",
        "max_decode_bytes",
        "max_frames",
        "max_decoded_frames",
        "threads",
    ):
        _require(
            getattr(d, name) >= 1, f"video.decode.{name}", getattr(d, name), "a positive number"
        )
    _require(
        d.max_duration_s > 0, "video.decode.max_duration_s", d.max_duration_s, "positive seconds"
    )
    _require(
        d.max_decode_s is None or d.max_decode_s > 0,
        "video.decode.max_decode_s",
        d.max_decode_s,
        "null (off) or positive seconds",
    )
    _require(
        cfg.max_video_bytes >= 1, "max_video_bytes", cfg.max_video_bytes, "a positive byte cap"
    )


def check_fields(cfg: DataConfig) -> None:
    """Each DataConfig field on its own: a value that cannot work (a packing budget that holds no
    sample, a non-positive size) is refused with the field, its value and what to set."""
    im, pk = cfg.image, cfg.pack
    _require(
        pk.seq_len >= 2,
        "pack.seq_len",
        pk.seq_len,
        "at least 2 tokens (a sample and its next-token target)",
    )
    _require(
        pk.max_samples >= 1,
        "pack.max_samples",
        pk.max_samples,
        "at least 1 (documents per packed row)",
    )
    _require(
        pk.max_patches >= 0, "pack.max_patches", pk.max_patches, "0 (text only) or more patches"
    )
    _require(pk.max_images >= 0, "pack.max_images", pk.max_images, "0 (text only) or more images")
    _require(pk.lookahead >= 0, "pack.lookahead", pk.lookahead, "0 or more samples")
    _require(pk.oversize in OVERSIZE, "pack.oversize", pk.oversize, _one_of(OVERSIZE))
    vision_budget(pk.max_vision_flops, pk.max_patches)  # off, auto or a positive number: ValueError
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        _require(getattr(im, name) >= 1, f"image.{name}", getattr(im, name), "a positive integer")
    _require(im.min_pixels >= 1, "image.min_pixels", im.min_pixels, "a positive pixel count")
    _require(
        im.max_pixels >= im.min_pixels,
        "image.max_pixels",
        im.max_pixels,
        f"at least data.image.min_pixels={im.min_pixels} (or lower min_pixels)",
    )
    _require(
        im.max_image_pixels >= 1,
        "image.max_image_pixels",
        im.max_image_pixels,
        "a positive width*height limit (default 100000000)",
    )
    _require(
        im.max_decode_bytes >= 1,
        "image.max_decode_bytes",
        im.max_decode_bytes,
        "a positive byte budget (default 400000000)",
    )
    _check_normalisation("image", im)
    _require(
        cfg.max_text_bytes >= 1,
        "max_text_bytes",
        cfg.max_text_bytes,
        "a positive byte cap (default 1048576)",
    )
    _require(
        cfg.max_image_bytes >= 1,
        "max_image_bytes",
        cfg.max_image_bytes,
        "a positive byte cap (default 33554432)",
    )
    check_video(cfg)
    _require(
        cfg.num_workers >= 0,
        "num_workers",
        cfg.num_workers,
        "0 (read in the training process) or more",
    )
    _require(
        cfg.prefetch_factor >= 1,
        "prefetch_factor",
        cfg.prefetch_factor,
        "at least 1 row per worker",
    )
    _require(
        cfg.shuffle_buffer >= 0,
        "shuffle_buffer",
        cfg.shuffle_buffer,
        "0 (shard order) or more samples",
    )
    _require(
        cfg.epochs is None or cfg.epochs >= 1,
        "epochs",
        cfg.epochs,
        "null (loop forever) or at least 1",
    )
    _require(
        str(cfg.pin_memory).lower() in PIN_MEMORY, "pin_memory", cfg.pin_memory, _one_of(PIN_MEMORY)
    )
    _require(cfg.mock in MOCK, "mock", cfg.mock, _one_of(MOCK))
    _require(cfg.format in FORMATS, "format", cfg.format, _one_of(FORMATS))
    _require(
        cfg.start_method in mp.get_all_start_methods(),
        "start_method",
        cfg.start_method,
        f"one of {mp.get_all_start_methods()}",
    )


def check_streams(cfg: DataConfig, world: int) -> int:
    """The asked-for L (data.streams, or DEFAULT_STREAMS for 0), checked alone (no shards needed)."""
    if cfg.streams < 0:
        raise ValueError(
            f"data.streams={cfg.streams}; use 0 (auto: {DEFAULT_STREAMS}) or a positive multiple "
            "of the data-parallel size"
        )
    if cfg.streams and cfg.streams % world:
        raise ValueError(
            f"data.streams={cfg.streams} is not a multiple of the data-parallel size {world}; set "
            f"data.streams to a multiple of {world} (or 0: auto)"
        )
    return cfg.streams or DEFAULT_STREAMS


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


# how the tools that write shards make more of them (whichever wrote these)
SMALLER_SHARDS = (
    "moevlm.data.build_shards --samples-per-shard, img2dataset --number_sample_per_shard, "
    "webdataset's ShardWriter maxcount"
)


def resolve_streams(cfg: DataConfig, rank: int, world: int, num_shards: int) -> tuple[int, int]:
    """(L, workers): the job's logical streams and this rank's worker processes, fitted to the shards
    and the layout (a warning for each reduction; an error only where no stream layout can work)."""
    if not 0 <= rank < world:
        raise ValueError(f"data-parallel rank {rank} is outside 0..{world - 1}")
    asked = check_streams(cfg, world)
    # depends on the shards only, never on the layout
    L = _largest_divisor_at_most(asked, num_shards)
    if L < asked:
        log.warning(
            "%d shards cannot feed %d data streams (each needs a shard): reading them as %d streams "
            "(data.streams=%d%s); for more, rebuild the shards as more, smaller ones with the tool that "
            "wrote them: %s",
            num_shards,
            asked,
            L,
            cfg.streams,
            " (auto)" if not cfg.streams else "",
            SMALLER_SHARDS,
        )
    if L % world and not cfg.streams and world <= num_shards:
        L = world * (min(max(DEFAULT_STREAMS, world), num_shards) // world)
        log.warning(
            "data.streams=0 (auto): the %d data-parallel ranks cannot share %d streams evenly; reading "
            "%d streams, so the rows of a step differ from a run on 1, 2, 4, 8 or 16 ranks; set "
            "data.streams to a common multiple of the data-parallel sizes you use to make them equal",
            world,
            min(DEFAULT_STREAMS, num_shards),
            L,
        )
    if L % world:
        raise ValueError(
            f"{num_shards} shards cannot feed {world} data-parallel ranks with data.streams={asked}"
            f"{' (auto)' if not cfg.streams else ''}: they give {L} streams, not a multiple of {world}; "
            f"rebuild the shards as more, smaller ones with the tool that wrote them: {SMALLER_SHARDS} "
            f"(at least {asked} shards), or "
            f"set data.streams to a multiple of {world} that is at most {num_shards}"
        )
    return L, _workers(cfg, L // world)


def _workers(cfg: DataConfig, per_rank: int) -> int:
    """data.num_workers, lowered (with a warning) to a divisor of the streams each rank serves."""
    if cfg.num_workers <= 1:
        return cfg.num_workers
    w = _largest_divisor_at_most(per_rank, cfg.num_workers)
    if w < cfg.num_workers:
        log.warning(
            "data.num_workers=%d lowered to %d: each data-parallel rank serves %d streams, which %d "
            "workers cannot share evenly (the rows are the same; raise data.streams for more workers)",
            cfg.num_workers,
            w,
            per_rank,
            cfg.num_workers,
        )
    return w


SAMPLE_TOKENIZER = "the sample set's"  # tokenizer_choice's source when it falls back to it


def sample_tokenizer_fits(model) -> bool:
    """The sample set's tokenizer (TINY_SPECIAL_IDS) fits `model` (the tiny preset's ids)."""
    return not model_mismatches(TINY_SPECIAL_IDS, max(TINY_SPECIAL_IDS.values()) + 1, model)


def find_tokenizer(cfg: DataConfig, shards: list[str], hf_checkpoint: str = "") -> str:
    """The tokenizer.json to use (tokenizer_choice, without the sample set's)."""
    return tokenizer_choice(cfg, shards, hf_checkpoint)[0]


def tokenizer_choice(cfg: DataConfig, shards: list[str], hf_checkpoint: str = "", sample=None):
    """(tokenizer.json, where from): data.tokenizer, else the one beside the (first) shards (none for
    []), else the checkpoint's, else `sample()` (the sample set's, when given); one message naming all
    three when none is there."""
    # data.tokenizer: a file, or a folder holding tokenizer.json (as build_shards --tokenizer takes)
    if cfg.tokenizer:
        file = cfg.tokenizer
        if os.path.isdir(file):
            file = os.path.join(file, "tokenizer.json")
        if not os.path.isfile(file):
            raise DataSetupError(
                f"data.tokenizer={shown_path(cfg.tokenizer)} is not a file"
                + (" and the folder has no tokenizer.json" if file != cfg.tokenizer else "")
                + "; point it at a tokenizer.json (e.g. the checkpoint's) or a folder holding one, or "
                "leave it empty to use <shards folder>/tokenizer.json"
            )
        return file, "data.tokenizer"
    beside = (
        os.path.join(os.path.dirname(os.path.abspath(shards[0])), "tokenizer.json")
        if shards
        else ""
    )
    ckpt = os.path.join(hf_checkpoint, "tokenizer.json") if hf_checkpoint else ""
    for path, source in ((beside, "beside the shards"), (ckpt, "model.hf_checkpoint's")):
        if path and os.path.isfile(path):
            return path, source
    if sample is not None:
        return sample(), SAMPLE_TOKENIZER
    raise DataSetupError(
        "no tokenizer: data.tokenizer is not set, "
        + (f"{beside} does not exist and " if beside else "")
        + (f"{ckpt} does not either" if ckpt else "model.hf_checkpoint is not set")
        + "; do one of: set data.tokenizer=FILE (a tokenizer.json, e.g. the checkpoint's), rebuild the shards "
        "with `python -m moevlm.data.build_shards ... --tokenizer FILE` (copies it beside them), or set "
        "model.hf_checkpoint=DIR (a folder holding tokenizer.json)"
    )


def check_job_data(d: DataConfig, model, dp: int = 1, tp: int = 1, cp: int = 1) -> None:
    """The data as the job uses it: shards named, each field in range and the image geometry the
    model's (check_config), the packed row within the model's positions and cut
    evenly by the layout's dp x cp x tp.  ValueError (moevlm.config.validation reports it) on the first."""
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
    (resolve_streams), applied here, on every rank, before anything is built.  At loader build
    it would come too late on a pipeline: only the first stage's ranks build a loader, and the other
    stages would wait for them until the collective timeout."""
    for key, spec in (("data.shards", d.shards), ("data.val_shards", d.val_shards)):
        if spec in ("", "sample", MISSING) or not isinstance(spec, str) or is_dataset(spec):
            continue  # a datasets output's shards are counted when it is converted
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
    if data.shards in ("", MISSING):
        return
    sample = data.shards == "sample" and not data.tokenizer
    path = None if sample else _find_tokenizer(data, hf_checkpoint, model)
    if sample or path == SAMPLE_TOKENIZER:
        ids, vocab = TINY_SPECIAL_IDS, max(TINY_SPECIAL_IDS.values()) + 1
        source = "the sample set's tokenizer (data.shards=sample: a small BPE for the tiny model)"
    else:
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


def _find_tokenizer(data: DataConfig, hf_checkpoint: str, model) -> str | None:
    """The tokenizer.json the loader will use (SAMPLE_TOKENIZER: the sample set's); None when the
    shards cannot be listed (reported elsewhere).  DataSetupError (a ConfigError) names the three
    places when there is none."""
    fits = not hf_checkpoint and sample_tokenizer_fits(model)
    sample = (lambda: SAMPLE_TOKENIZER) if fits else None
    if data.tokenizer or data.shards == "sample" or is_dataset(data.shards):
        return tokenizer_choice(data, [], hf_checkpoint, sample)[0]
    try:
        shards = expand_shards(data.shards)
    except FileNotFoundError:
        return None
    return tokenizer_choice(data, shards, hf_checkpoint, sample)[0]


def _tokenizer_ids(path: str) -> tuple[dict[str, int], int]:
    """(special token -> id, number of ids) of the tokenizer.json at `path`."""
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


def check_shards(spec: str, split: str = "") -> None:
    """A shard spec that names nothing readable (the sample set and the empty value are checked
    elsewhere); a `datasets` output is opened (its split, its files' columns), not converted yet."""
    if spec in ("", "sample", MISSING) or not isinstance(spec, str):
        return
    if is_dataset(spec):
        try:
            open_dataset(spec, split or None)
        except (ValueError, OSError) as err:
            raise ValueError(f"data.shards={shown_path(spec)}: {err}") from None
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
    shards = expand_shards(spec)  # naming nothing that exists: DataSetupError
    missing = [s for s in shards if not os.path.isfile(s)]
    check(
        not missing,
        f"data.shards={spec} names {len(missing)} shard(s) that do not exist, e.g. {missing[:3]}",
        ValueError,
    )
