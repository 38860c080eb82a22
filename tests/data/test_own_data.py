"""A user's own data: the builder's automatic shard size and --tokenizer, where the
loader finds the tokenizer, and what a missing shards folder or tokenizer says."""

import dataclasses
import json
import shutil

import pytest
from data_helpers import small_data_config

from moevlm.data.build_shards import auto_samples_per_shard, main
from moevlm.data.errors import DataSetupError
from moevlm.data.loader import build_loader
from moevlm.data.sample import sample_photo_paths
from moevlm.model import ConfigError, VLMConfig

TINY = VLMConfig.preset("tiny")


def captions(tmp_path, n):
    """An images folder of the packaged photos and a caption JSONL of n records naming them."""
    images = tmp_path / "images"
    images.mkdir()
    photos = sample_photo_paths()
    for p in photos:
        shutil.copy(p, images / p.name)
    lines = [
        json.dumps({"image": photos[i % len(photos)].name, "caption": f"photo {i}"})
        for i in range(n)
    ]
    # no final newline: the last line still counts
    (tmp_path / "caps.jsonl").write_text("\n".join(lines))
    return images, tmp_path / "caps.jsonl"


def test_auto_shard_size_gives_several_shards_and_tokenizer_is_copied(
    tmp_path, sample_shards, capsys
):
    assert [auto_samples_per_shard(n) for n in (0, 7, 64, 65, 10_000, 64_000, 10**7)] == [
        1,
        1,
        1,
        2,
        157,
        1000,
        1000,
    ]
    images, caps = captions(tmp_path, 20)
    out = tmp_path / "shards"
    argv = ["--images", str(images), "--annotations", str(caps), "--out", str(out)]
    assert main(argv) == 0
    # says where training will look instead
    assert "no tokenizer.json in" in capsys.readouterr().out
    # 20 records: one a shard
    assert len(json.loads((out / "summary.json").read_text())["shards"]) == 20
    # a folder: its tokenizer.json
    assert main(argv + ["--overwrite", "--tokenizer", str(sample_shards)]) == 0
    assert (out / "tokenizer.json").read_bytes() == (sample_shards / "tokenizer.json").read_bytes()
    assert main(argv + ["--overwrite", "--tokenizer", str(caps)]) == 2
    assert "is not a tokenizer.json the tokenizers library loads" in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--tokenizer", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: no such file" in capsys.readouterr().err


def test_tokenizer_is_found_in_order_and_its_absence_names_every_place(tmp_path, sample_shards):
    for p in sorted(sample_shards.glob("shard-*.tar"))[:4]:
        shutil.copy(p, tmp_path / p.name)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with pytest.raises(
        ConfigError,
        match=r"no tokenizer: data.tokenizer is not set, \S+/tokenizer.json does not "
        r"exist and \S+ckpt/tokenizer.json does not either; do one of: set "
        r"data.tokenizer=FILE .* --tokenizer FILE.* model.hf_checkpoint=DIR",
    ):
        build_loader(small_data_config(tmp_path), TINY, hf_checkpoint=str(ckpt))
    # no checkpoint: the tiny model takes the sample set's; a model its ids do not fit, nothing
    sample = str(sample_shards / "tokenizer.json")
    assert build_loader(small_data_config(tmp_path), TINY).tokenizer_path == sample
    other = dataclasses.replace(TINY, image_token_id=TINY.image_token_id + 1)
    with pytest.raises(DataSetupError, match="model.hf_checkpoint is not set"):
        build_loader(small_data_config(tmp_path), other)
    shutil.copy(sample_shards / "tokenizer.json", ckpt / "tokenizer.json")
    assert build_loader(
        small_data_config(tmp_path), TINY, hf_checkpoint=str(ckpt)
    ).tokenizer_path == str(ckpt / "tokenizer.json")
    # beside the shards wins
    shutil.copy(sample_shards / "tokenizer.json", tmp_path / "tokenizer.json")
    assert build_loader(
        small_data_config(tmp_path), TINY, hf_checkpoint=str(ckpt)
    ).tokenizer_path == str(tmp_path / "tokenizer.json")
    mine = str(sample_shards / "tokenizer.json")  # data.tokenizer wins over both
    assert build_loader(small_data_config(tmp_path, tokenizer=mine), TINY).tokenizer_path == mine
    with pytest.raises(DataSetupError, match=r"data.tokenizer=\S+nope.json is not a file"):
        build_loader(small_data_config(tmp_path, tokenizer=str(tmp_path / "nope.json")), TINY)


def test_missing_or_empty_shards_folder_is_about_the_shards(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"no shards found for data.shards='\S+gone': it names no folder or file "
        r"that exists; .*build_shards",
    ):
        build_loader(small_data_config(tmp_path / "gone"), TINY)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="it is a folder without .tar shards"):
        build_loader(small_data_config(tmp_path / "empty"), TINY)
