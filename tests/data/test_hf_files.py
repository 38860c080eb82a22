"""The exported folder's tokenizer, chat template and image processor load in transformers and give what
training used: the same token ids as ChatEncoder, the same pixels as our image pipeline."""

from __future__ import annotations

import json

import pytest
import torch

from moevlm.data.config import ImageConfig
from moevlm.data.hf_files import write_processor_files
from moevlm.data.image import decode_image
from moevlm.data.sample import sample_photo_paths
from moevlm.data.text import ChatEncoder, load_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(sample_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_out")
    image = ImageConfig(min_pixels=64 * 64, max_pixels=128 * 128)
    names = write_processor_files(out, tokenizer=sample_shards / "tokenizer.json", image=image)
    assert sorted(names) == ["preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"]
    return out, image, ChatEncoder(load_tokenizer(sample_shards / "tokenizer.json"))


def test_tokenizer_and_chat_template_give_the_training_ids(exported):
    out, _, chat = exported
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token_id, tok.pad_token_id) == (chat.im_end_id, chat.eot_id)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\nWhat is in the picture?"},
        {"role": "assistant", "content": "A cat on a mat."},
    ]
    want, _ = chat.encode_chat(messages, image_tokens=[6])
    got = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    # the processor's expansion
    expanded = [t for i in got for t in ([pad] * 6 if i == pad else [i])]
    assert expanded == want
    as_items = [
        messages[0],
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is in the picture?"}],
        },
        messages[2],
    ]
    assert tok.apply_chat_template(as_items, tokenize=True, return_dict=True)["input_ids"] == got
    prompt = tok.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_image_processor_gives_the_training_pixels(exported):
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    out, image, _ = exported
    config = json.loads((out / "preprocessor_config.json").read_text())
    assert (config["patch_size"], config["merge_size"], config["temporal_patch_size"]) == (16, 2, 2)
    proc = pil.Qwen2VLImageProcessorPil.from_pretrained(out)
    path = sample_photo_paths()[0]
    ours, grid = decode_image(path.read_bytes(), image)
    from PIL import Image

    theirs = proc(images=[Image.open(path)], return_tensors="pt")
    assert theirs["image_grid_thw"].tolist() == [list(grid)]
    torch.testing.assert_close(theirs["pixel_values"].float(), ours.float(), atol=2e-2, rtol=0)


def test_a_checkpoints_own_files_are_kept(exported, tmp_path):
    out, image, _ = exported
    src = tmp_path / "hf_in"
    src.mkdir()
    (src / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "x": 1}'
    )
    (src / "chat_template.jinja").write_text("{{ messages }}")
    dest = tmp_path / "out"
    names = write_processor_files(dest, tokenizer=out / "tokenizer.json", image=image, source=src)
    assert sorted(names) == [
        "chat_template.jinja",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((dest / "tokenizer_config.json").read_text())["x"] == 1
