"""What Hugging Face `datasets` saves, written by `datasets` itself and read as it is: Parquet with
embedded bytes, relative and absolute paths, a multi-file Parquet folder with splits, `save_to_disk`
and `DatasetDict` folders, `Image` and `Sequence(Image)` columns, ShareGPT and OpenAI chat columns.
Every form gives the same image tokens as the same samples built from embedded bytes."""

from __future__ import annotations

import copy
import io
import json
import logging
import shutil

import pytest
from data_helpers import small_data_config, write_tar
from PIL import Image as PILImage

from moevlm.config import compose_job, validate
from moevlm.data import build_shards as bs
from moevlm.data import loader as loader_module
from moevlm.data.errors import DataSetupError
from moevlm.data.hf_datasets import is_dataset, open_dataset
from moevlm.data.loader import build_loader
from moevlm.data.text import ChatEncoder, load_tokenizer
from moevlm.model import ConfigError, VLMConfig
from moevlm.train.trainer import Trainer

datasets = pytest.importorskip("datasets")
TINY = VLMConfig.preset("tiny")
N = 4


def _png(i: int) -> bytes:
    im = PILImage.linear_gradient("L").resize((40 + 8 * i, 36)).convert("RGB")
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _captions(images) -> datasets.Dataset:
    ds = datasets.Dataset.from_dict({"image": images, "caption": [f"photo {i}" for i in range(N)]})
    return ds.cast_column("image", datasets.Image())


def _pairs(images) -> datasets.Dataset:
    """Two images a row in a Sequence(Image) column, asked about in OpenAI content parts."""
    user = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "the two?"}]
    rows = {
        "images": [[images[i], images[(i + 1) % N]] for i in range(N)],
        "messages": [
            [
                {"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": f"pair {i}"}]},
            ]
            for i in range(N)
        ],
    }
    return datasets.Dataset.from_dict(rows).cast_column("images", datasets.List(datasets.Image()))


def _sharegpt(images) -> datasets.Dataset:
    rows = {
        "image": images,
        "conversations": [
            [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": f"photo {i}"}]
            for i in range(N)
        ],
    }
    return datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())


@pytest.fixture(scope="module")
def forms(tmp_path_factory, sample_shards):
    """{form: (builder argv, reference form)}: each written by `datasets`."""
    root = tmp_path_factory.mktemp("hf")
    (root / "imgs").mkdir()
    blobs = [_png(i) for i in range(N)]
    rel = [f"imgs/{i}.png" for i in range(N)]
    for name, data in zip(rel, blobs):
        (root / name).write_bytes(data)
    absolute = [str(root / p) for p in rel]
    embedded = [{"bytes": b, "path": None} for b in blobs]
    _captions(embedded).to_parquet(str(root / "bytes.parquet"))
    _captions(absolute).to_parquet(str(root / "abs.parquet"))
    with pytest.MonkeyPatch.context() as mp:  # relative paths, as a user in `root` writes them
        mp.chdir(root)
        _captions(rel).to_parquet("rel.parquet")
        _sharegpt(rel).to_parquet("sharegpt_rel.parquet")
    multi = root / "multi" / "data"
    multi.mkdir(parents=True)
    caps = _captions(embedded)
    caps.select(range(2)).to_parquet(str(multi / "train-00000-of-00002.parquet"))
    caps.select(range(2, N)).to_parquet(str(multi / "train-00001-of-00002.parquet"))
    caps.select(range(1)).to_parquet(str(multi / "test-00000-of-00001.parquet"))
    _captions(absolute).save_to_disk(str(root / "disk"))
    dd = datasets.DatasetDict({"train": _captions(absolute), "test": caps.select(range(1))})
    dd.save_to_disk(str(root / "dict"))
    _pairs(embedded).to_parquet(str(root / "pairs_bytes.parquet"))
    _pairs(absolute).save_to_disk(str(root / "pairs_disk"))
    _sharegpt(embedded).to_parquet(str(root / "sharegpt_bytes.parquet"))
    tok = ["--tokenizer", str(sample_shards / "tokenizer.json")]
    argv = {
        "bytes": (["--parquet", str(root / "bytes.parquet")], "bytes"),
        "absolute": (["--parquet", str(root / "abs.parquet")], "bytes"),
        "relative": (["--parquet", str(root / "rel.parquet")], "bytes"),
        "parquet_folder": (["--parquet", str(root / "multi")], "bytes"),
        "save_to_disk": (["--dataset", str(root / "disk")], "bytes"),
        "dataset_dict": (["--dataset", str(root / "dict")], "bytes"),
        "pairs_bytes": (["--parquet", str(root / "pairs_bytes.parquet")], "pairs_bytes"),
        "pairs_disk": (["--dataset", str(root / "pairs_disk")], "pairs_bytes"),
        "sharegpt_bytes": (["--parquet", str(root / "sharegpt_bytes.parquet")], "sharegpt_bytes"),
        "sharegpt_rel": (["--dataset", str(root / "sharegpt_rel.parquet")], "sharegpt_bytes"),
    }
    out = {}
    for name, (args, ref) in argv.items():
        assert bs.main([*args, "--out", str(root / "out" / name), *tok]) == 0, name
        out[name] = (root / "out" / name, ref)
    return root, out


def _image_tokens(folder) -> tuple[int, int, int]:
    """(samples read, images packed, image tokens) over one epoch, in the training process."""
    cfg = small_data_config(folder, num_workers=0, epochs=1, shuffle_buffer=0)
    with build_loader(cfg, TINY) as loader:
        pad = ChatEncoder(load_tokenizer(loader.tokenizer_path)).image_pad_id
        tokens = sum(int((row["input_ids"] == pad).sum()) for row in loader)
        st = loader.stats()
    return st["samples_read"], st["images_packed"], tokens


def test_every_form_gives_the_embedded_bytes_image_tokens(forms):
    _, built = forms
    figures = {name: _image_tokens(folder) for name, (folder, _) in built.items()}
    for name, (folder, ref) in built.items():
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["samples"] == N and summary["skipped"] == {}, (name, summary["skipped"])
        assert figures[name] == figures[ref], name
        assert figures[name][2] > 0, name
    assert figures["pairs_bytes"][1] == 2 * N
    for name, f in figures.items():  # pytest -s shows them
        print(f"{name}: {f[0]} samples read, {f[1]} images packed, {f[2]} image tokens")


def test_splits_paths_and_detection(forms, tmp_path, capsys):
    root, _ = forms
    # a DatasetDict: train by default, another split by --split; a missing split lists them
    assert open_dataset(root / "dict").split == "train"
    assert open_dataset(root / "dict", "test").total == 1
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]: choose one"):
        open_dataset(root / "dict", "validation")
    # a Parquet folder named by split: only train's files unless told
    assert open_dataset(root / "multi").total == N
    assert open_dataset(root / "multi", "test").total == 1
    assert is_dataset(root / "disk") and is_dataset(root / "abs.parquet")
    assert not is_dataset(root / "out" / "bytes") and not is_dataset(root / "imgs")
    # absolute paths confined to a named root only when asked
    out = tmp_path / "confined"
    args = ["--parquet", str(root / "abs.parquet"), "--out", str(out)]
    assert bs.main([*args, "--images", str(root / "multi"), "--images-root-only"]) == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["skipped"] == {"outside_images": N}
    assert str(root / "imgs") not in json.dumps(s["skipped_examples"])  # the path is not echoed
    assert bs.main([*args, "--images", str(root), "--images-root-only", "--overwrite"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bs.main([*args, "--images-root-only"])
    assert "--images-root-only needs --images DIR" in capsys.readouterr().err


@pytest.mark.slow
def test_data_shards_trains_on_datasets_outputs_converted_once(forms, tmp_path, caplog):
    """data.shards=<a datasets output> in every form the module writes, default settings and no
    tokenizer: converted once into the cache (a line, then reused), the tiny model takes the sample
    set's tokenizer (a line), 3 steps."""
    root, _ = forms
    every_form = {
        "abs": "abs.parquet",
        "disk": "disk",
        "dict": "dict",
        "bytes": "bytes.parquet",
        "rel": "rel.parquet",
        "folder": "multi",
        "pairs_bytes": "pairs_bytes.parquet",
        "pairs_disk": "pairs_disk",
        "sharegpt_bytes": "sharegpt_bytes.parquet",
        "sharegpt_rel": "sharegpt_rel.parquet",
    }
    for name, spec in every_form.items():
        for attempt in ("converted", "reused"):
            run_dir = tmp_path / f"{name}-{attempt}"
            job = compose_job(
                [f"data.shards={root / spec}", "data.num_workers=0", "train.steps=3"]
                + [f"train.run_dir={run_dir}", "train.checkpoint_every=0"]
            )
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="moevlm.data.loader"):
                trainer = Trainer(job)
                assert trainer.run() == 0, name
            assert trainer.loader.stats()["images_packed"] > 0, name
            said = caplog.text
            if attempt == "converted":
                images = 8 if name.startswith("pairs") else 4
                assert (
                    f"converting {root / spec} (" in said
                    and f"converted 4 samples, {images} images" in said
                ), (name, said)
            else:
                assert "reusing its conversion" in said and "converting" not in said, name
            assert "tokenizer: the sample set's " in said, name
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
            assert json.loads(lines[-1])["step"] == 3, name
            if name != "abs":
                break  # reuse is shown once


@pytest.mark.slow
def test_tiny_model_trains_on_img2dataset_shards_without_a_tokenizer(tmp_path, caplog):
    """img2dataset's layout (KEY.png + KEY.txt + KEY.json), no tokenizer anywhere: the tiny preset
    takes the sample set's and says so in one line."""
    folder = tmp_path / "img2dataset"
    folder.mkdir()
    samples = [
        {
            "__key__": f"{i:09d}",
            "png": _png(i),
            "txt": f"photo {i}".encode(),
            "json": json.dumps({"caption": f"photo {i}", "url": f"http://x/{i}"}).encode(),
        }
        for i in range(N)
    ]
    write_tar(folder / "00000.tar", samples[:2])
    write_tar(folder / "00001.tar", samples[2:])
    run_dir = tmp_path / "run"
    job = compose_job(
        [f"data.shards={folder}", "train.steps=3", f"train.run_dir={run_dir}"]
        + ["data.num_workers=0", "train.checkpoint_every=0"]
    )
    with caplog.at_level(logging.INFO, logger="moevlm.data.loader"):
        trainer = Trainer(job)
        assert trainer.run() == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tokenizer:")]
    assert len(said) == 1 and "the sample set's" in said[0] and "no model.hf_checkpoint" in said[0]
    assert trainer.loader.stats()["images_packed"] > 0


def test_the_tokenizer_chosen_is_said(sample_shards, tmp_path, caplog):
    """A checkpoint's tokenizer is named in a line; a model the tiny ids do not fit gets no sample
    tokenizer but the message naming the three places."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(sample_shards / "tokenizer.json", ckpt)
    cfg = small_data_config(tmp_path / "none.tar")
    with caplog.at_level(logging.INFO, logger="moevlm.data.loader"):
        tok = loader_module._tokenizer(cfg, TINY, str(ckpt), [], True)
    assert tok == str(ckpt / "tokenizer.json")
    assert f"tokenizer: {ckpt / 'tokenizer.json'} (model.hf_checkpoint's)" in caplog.text
    other = copy.deepcopy(TINY)
    other.image_token_id += 1
    with pytest.raises(DataSetupError, match="^no tokenizer: data.tokenizer is not set, "):
        loader_module._tokenizer(cfg, other, "", [], True)


def test_a_datasets_split_that_is_not_there_is_one_config_line(forms):
    root, _ = forms
    with pytest.raises(ConfigError) as err:
        validate(compose_job([f"data.shards={root / 'dict'}", "data.split=validation"]))
    (line,) = str(err.value).splitlines()
    assert line.startswith(f"data.shards={root / 'dict'}: ") and "splits ['train', 'test']" in line
    validate(compose_job([f"data.shards={root / 'dict'}", "data.split=test"]))
