"""Bad input through the whole loader (2 worker processes): every case is
skipped and counted by reason, and every good sample still arrives once.

The shards are written by hand, as a third party's would be (no summary.json)."""

import json
import shutil
import zlib
from collections import Counter

import numpy as np
from data_helpers import encoded, good, small_data_config, text, write_tar
from PIL import Image

from moevlm.data.loader import build_loader
from moevlm.data.sample import sample_photo_paths
from moevlm.model import VLMConfig


def corrupt_png(png: bytes) -> bytes:
    """Garble the compressed pixel data (IDAT) of a real PNG and fix its CRC, so
    only decompression can notice."""
    at = png.index(b"IDAT")
    n = int.from_bytes(png[at - 4 : at], "big")
    body = bytearray(png[at + 4 : at + 4 + n])
    body[2 : n - 4] = bytes(reversed(body[2 : n - 4]))
    crc = zlib.crc32(b"IDAT" + bytes(body)).to_bytes(4, "big")
    return png[: at + 4] + bytes(body) + crc + png[at + 8 + n :]


def test_every_bad_input_is_skipped_counted_and_the_rest_arrives(tmp_path, sample_shards):
    photos = [Image.open(p).convert("RGB") for p in sample_photo_paths()[:3]]
    small = [encoded(p.resize((48, 40)), "PNG") for p in photos]
    small_jpg = encoded(photos[0].resize((64, 48)), "JPEG")
    big = encoded(photos[1].resize((400, 300)), "PNG")  # above max_image_pixels below
    bad = {
        "bad_image": [
            good("corrupt", corrupt_png(small[1])),
            good("truncated", small_jpg[: len(small_jpg) // 2], "jpg"),
        ],
        "empty_image": [good("zero", b"", "jpg")],
        "not_an_image": [good("notimg", b"<html>this is not a photo</html>", "jpg")],
        "image_too_large": [good("bomb", big)],
        "bad_json": [
            {"__key__": "nojson", "img0.png": small[0]},
            {"__key__": "badjson", "json": b'{"id": "x", "text": '},
        ],
        "bad_text_encoding": [
            {"__key__": "latin1", "json": '{"id": "l", "text": "caf\xe9"}'.encode("latin-1")}
        ],
        "image_tag_mismatch": [
            {
                **good("tags", small[2]),
                "json": json.dumps(
                    {
                        "id": "tags",
                        "images": ["img0.png"],
                        "messages": [
                            {"role": "user", "content": "<image><image> compare"},
                            {"role": "assistant", "content": "same"},
                        ],
                    }
                ).encode(),
            }
        ],
        "missing_image": [{"__key__": "lost", "json": good("lost", b"")["json"]}],
        "too_long": [text("long", "word " * 3000)],
    }
    goods = [good(f"g{i}", small[i % 3]) for i in range(6)] + [
        text(f"t{i}", f"plain text {i}. " * 5) for i in range(6)
    ]
    goods.append(good("jpeg-ok", small_jpg, "jpg"))
    bad_samples = [s for v in bad.values() for s in v]
    write_tar(tmp_path / "a.tar", goods[:4] + bad_samples[:6])
    write_tar(tmp_path / "b.tar", goods[4:8] + bad_samples[6:])
    write_tar(tmp_path / "c.tar", goods[8:11])
    # a shard cut in the middle of its 3rd sample's image: the first two still arrive
    write_tar(tmp_path / "full.tar", goods[11:13] + [good("cut", big)])
    blob = (tmp_path / "full.tar").read_bytes()
    (tmp_path / "d.tar").write_bytes(blob[: blob.index(b"cut.img0.png") + 2000])
    (tmp_path / "full.tar").unlink()
    (tmp_path / "e.tar").write_bytes(np.random.default_rng(0).bytes(5000))  # not a tar at all
    shards = [str(tmp_path / f"{c}.tar") for c in "abcde"] + [str(tmp_path / "missing.tar")]
    shutil.copy(sample_shards / "tokenizer.json", tmp_path / "tokenizer.json")

    cfg = small_data_config(
        ",".join(shards), tokenizer=str(tmp_path / "tokenizer.json"), epochs=1, streams=2
    )
    cfg.pack.oversize = "skip"
    cfg.image.max_image_pixels = 100_000
    loader = build_loader(cfg, VLMConfig.preset("tiny"))
    seen = Counter(sid for batch in loader for sid in batch["sample_ids"])

    assert seen == Counter(s["__key__"] for s in goods)
    want = {reason: len(v) for reason, v in bad.items()}
    want.update(truncated_shard=2, unreadable_shard=1)
    assert loader.stats()["skipped"] == want
    assert sum(want.values()) == 14  # 11 bad samples of 9 kinds, 3 bad shards
