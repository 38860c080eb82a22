"""Raw sample -> Sample: images first (their token counts), chat or text
tokens, 3-D positions, and the over-budget rule (skip, or truncate before the
first image that no longer fits)."""

import io
import json

import pytest
import torch
from PIL import Image

from moevlm.data.config import ImageConfig, PackConfig
from moevlm.data.encode import SampleEncoder
from moevlm.data.errors import SkipSample
from moevlm.data.sample import sample_photo_paths, sample_tokenizer
from moevlm.data.text import IGNORE_INDEX as IGNORE
from moevlm.data.text import ChatEncoder
from moevlm.model import VLMConfig
from moevlm.model.rope import mrope_position_ids

TINY = VLMConfig.preset("tiny")
# every photo -> 16 patches -> 4 image tokens
IMAGE = ImageConfig(min_pixels=64 * 64, max_pixels=64 * 64)


@pytest.fixture(scope="module")
def chat():
    return ChatEncoder(sample_tokenizer())


def png(i):
    buf = io.BytesIO()
    Image.open(sample_photo_paths()[i]).save(buf, "PNG")
    return buf.getvalue()


def two_image_chat():
    rec = {
        "id": "two",
        "images": ["img0.png", "img1.png"],
        "messages": [
            {"role": "user", "content": "<image>\nFirst photo. What is it?"},
            {"role": "assistant", "content": "A person in a space suit."},
            {"role": "user", "content": "And this one? <image>"},
            {"role": "assistant", "content": "A cat."},
        ],
    }
    return {
        "__key__": "k",
        "json": json.dumps(rec).encode(),
        "img0.png": png(0),
        "img1.png": png(6),
    }


def encoder(chat, **pack):
    return SampleEncoder(chat, IMAGE, PackConfig(**pack))


def test_chat_with_two_images(chat):
    s = encoder(chat)(two_image_chat(), (0, 1, 2))
    assert (s.id, s.pos, s.grids, s.patches) == ("two", (0, 1, 2), [(1, 4, 4), (1, 4, 4)], 32)
    assert int((s.input_ids_L == TINY.image_token_id).sum()) == 8
    ref = mrope_position_ids(s.input_ids_L[None], torch.tensor(s.grids), TINY.image_token_id, 2)[
        :, 0
    ]
    assert torch.equal(s.position_ids_3L, ref)
    trained = chat.tokenizer.decode(
        s.labels_L[s.labels_L != IGNORE].tolist(), skip_special_tokens=False
    )
    assert trained == "A person in a space suit.<|im_end|>A cat.<|im_end|>"


def test_over_budget_is_skipped_by_default(chat):
    with pytest.raises(SkipSample, match="too_long") as err:
        encoder(chat, max_patches=16)(two_image_chat(), (0, 0, 0))
    assert "32 patches" in str(err.value)


@pytest.mark.parametrize("budget", [{"max_patches": 16}, {"max_images": 1}])
def test_truncate_cuts_before_the_first_image_that_does_not_fit(chat, budget):
    full = encoder(chat)(two_image_chat(), (0, 0, 0))
    s = encoder(chat, oversize="truncate", **budget)(two_image_chat(), (0, 0, 0))
    second_start = (full.input_ids_L == TINY.vision_start_token_id).nonzero()[1].item()
    assert s.tokens == second_start and torch.equal(s.input_ids_L, full.input_ids_L[:second_start])
    assert s.grids == [(1, 4, 4)] and torch.equal(s.pixels_ND, full.pixels_ND[:16])
    assert torch.equal(s.position_ids_3L, full.position_ids_3L[:, :second_start])


def test_truncate_text_at_seq_len_and_refuse_what_has_nothing_left(chat):
    doc = {"__key__": "t", "json": json.dumps({"id": "t", "text": "many words " * 200}).encode()}
    s = encoder(chat, seq_len=50, oversize="truncate")(doc, (0, 0, 0))
    assert s.tokens == 50 and (s.labels_L != IGNORE).all()
    # the cut falls inside the user's image
    with pytest.raises(SkipSample, match="nothing trainable"):
        encoder(chat, seq_len=4, oversize="truncate")(two_image_chat(), (0, 0, 0))


def test_third_party_txt_caption(chat):
    raw = {"__key__": "cap", "txt": "A cat on a chair.".encode(), "jpg": png(6)}
    s = encoder(chat)(raw, (0, 0, 0))
    assert s.grids == [(1, 4, 4)] and s.id == "cap"
    with pytest.raises(SkipSample, match="bad_text_encoding"):
        encoder(chat)({**raw, "txt": b"caf\xe9"}, (0, 0, 0))
