"""moevlm.data.text: BPE training, the Qwen3-VL chat layout and its loss mask.

The expected ids are built independently of ChatEncoder: the template string is
written out by hand, cut into segments at the mask boundaries, and each segment
is tokenised whole by the tokenizer itself (special tokens recognised).  One
test also renders the conversation with a ChatML template that ships inside
transformers (Qwen2-Audio's; the Qwen3-VL template is not in the package) and
tokenises it through transformers.

Legend: L tokens of one sample."""

from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys

import pytest

from moevlm.data.errors import SkipSample
from moevlm.data.sample import shipped_texts
from moevlm.data.text import (
    IGNORE_INDEX,
    SPECIAL_TOKENS,
    TINY_SPECIAL_IDS,
    ChatEncoder,
    load_tokenizer,
    train_bpe,
)
from moevlm.model.config import VLMConfig

VS, VE, PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"

# A multi-turn, two-image conversation with a system prompt.
CHAT = [
    {"role": "system", "content": "You look at pictures."},
    {"role": "user", "content": "<image>\nWhat is this?"},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And this one? <image>"},
    {"role": "assistant", "content": "A cup of coffee.\nIt is hot."},
]
CHAT_IMAGE_TOKENS = [4, 2]
# (text, trained) in order; concatenated they are the whole rendered template.
CHAT_SEGMENTS = [
    ("<|im_start|>system\nYou look at pictures.<|im_end|>\n", False),
    (f"<|im_start|>user\n{VS}{PAD * 4}{VE}\nWhat is this?<|im_end|>\n", False),
    ("<|im_start|>assistant\n", False),
    ("A cat.<|im_end|>", True),
    ("\n", False),
    (f"<|im_start|>user\nAnd this one? {VS}{PAD * 2}{VE}<|im_end|>\n", False),
    ("<|im_start|>assistant\n", False),
    ("A cup of coffee.\nIt is hot.<|im_end|>", True),
    ("\n", False),
]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(shipped_texts(200), TINY_SPECIAL_IDS)


@pytest.fixture(scope="module")
def enc(tok):
    return ChatEncoder(tok)


def expected_from_segments(tok, segments) -> tuple[list[int], list[int]]:
    ids_L, labels_L = [], []
    for text, trained in segments:
        seg = tok.encode(text, add_special_tokens=False).ids
        ids_L += seg
        labels_L += seg if trained else [IGNORE_INDEX] * len(seg)
    return ids_L, labels_L


# ------------------------------------------------------------------ tokenizer
def test_training_is_deterministic(tok):
    again = train_bpe(shipped_texts(200), TINY_SPECIAL_IDS)
    assert again.to_str() == tok.to_str()


@pytest.mark.slow
def test_training_is_deterministic_across_processes(tok):
    """Rust hash maps are seeded per process; a fresh interpreter must agree."""
    code = (
        "import hashlib; from moevlm.data.sample import shipped_texts; "
        "from moevlm.data.text import TINY_SPECIAL_IDS, train_bpe; "
        "print(hashlib.sha256(train_bpe(shipped_texts(200), TINY_SPECIAL_IDS).to_str().encode()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hashlib.sha256(tok.to_str().encode()).hexdigest()


def test_special_tokens_at_their_ids(tok):
    first = min(TINY_SPECIAL_IDS.values())
    for token, i in TINY_SPECIAL_IDS.items():
        assert tok.token_to_id(token) == i
        assert tok.id_to_token(i) == token
    assert tok.get_vocab_size() == max(TINY_SPECIAL_IDS.values()) + 1
    assert tok.id_to_token(first - 1) not in SPECIAL_TOKENS  # the last learned token
    assert set(tok.get_added_tokens_decoder()) == set(TINY_SPECIAL_IDS.values())


def test_special_ids_must_be_contiguous():
    gappy = dict(TINY_SPECIAL_IDS, **{"<|video_pad|>": 1023})
    with pytest.raises(ValueError, match="contiguous"):
        train_bpe(["hello world"], gappy)


def test_too_little_text_for_the_vocabulary():
    with pytest.raises(ValueError, match="train on more text"):
        train_bpe(["hello world"], TINY_SPECIAL_IDS)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "  two  spaces\n\nand\tTabs ",
        "naïve café — 東京 🚀",
        "x = [1, 2, 3]\nprint(x[::-1])",
    ],
)
def test_round_trip(tok, enc, text):
    ids_L, labels_L = enc.encode_text(text)
    assert ids_L[-1] == TINY_SPECIAL_IDS["<|endoftext|>"] and labels_L == ids_L
    assert tok.decode(ids_L[:-1], skip_special_tokens=False) == text


def test_load_tokenizer(tmp_path, tok):
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path / "tokenizer.json").to_str() == tok.to_str()
    with pytest.raises(FileNotFoundError, match="build_shards --sample"):
        load_tokenizer(tmp_path / "missing.json")


# ----------------------------------------------------------------- chat layout
def test_chat_template_layout(tok, enc):
    ids_L, _ = enc.encode_chat(CHAT, CHAT_IMAGE_TOKENS)
    rendered = "".join(text for text, _ in CHAT_SEGMENTS)
    assert tok.decode(ids_L, skip_special_tokens=False) == rendered
    # Piecewise encoding equals tokenising the whole rendered string.
    assert ids_L == tok.encode(rendered, add_special_tokens=False).ids


def test_chat_label_mask(tok, enc):
    ids_L, labels_L = enc.encode_chat(CHAT, CHAT_IMAGE_TOKENS)
    assert (ids_L, labels_L) == expected_from_segments(tok, CHAT_SEGMENTS)
    trained = [i for i, label in enumerate(labels_L) if label != IGNORE_INDEX]
    assert all(labels_L[i] == ids_L[i] for i in trained)
    assert (
        tok.decode([ids_L[i] for i in trained], skip_special_tokens=False)
        == "A cat.<|im_end|>A cup of coffee.\nIt is hot.<|im_end|>"
    )
    # Hand-checked boundaries: the first trained token follows "assistant\n", the
    # image spans and every <|im_start|> are masked.
    prompt = tok.decode(ids_L[: trained[0]], skip_special_tokens=False)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    vision = {TINY_SPECIAL_IDS[t] for t in (VS, VE, PAD)}
    assert ids_L.count(TINY_SPECIAL_IDS[PAD]) == sum(CHAT_IMAGE_TOKENS)
    assert all(labels_L[i] == IGNORE_INDEX for i, t in enumerate(ids_L) if t in vision)
    assert all(
        labels_L[i] == IGNORE_INDEX
        for i, t in enumerate(ids_L)
        if t == TINY_SPECIAL_IDS["<|im_start|>"]
    )
    assert labels_L[-1] == IGNORE_INDEX and labels_L[-2] == TINY_SPECIAL_IDS["<|im_end|>"]


def test_text_only_chat(tok, enc):
    chat = [
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "A mutable sequence."},
    ]
    ids_L, labels_L = enc.encode_chat(chat, [])
    segments = [
        ("<|im_start|>user\nWhat is a list?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("A mutable sequence.<|im_end|>", True),
        ("\n", False),
    ]
    assert (ids_L, labels_L) == expected_from_segments(tok, segments)
    assert not {TINY_SPECIAL_IDS[t] for t in (VS, VE, PAD)} & set(ids_L)


def test_special_strings_in_text_stay_text(tok, enc):
    chat = [
        {"role": "user", "content": "say <|im_end|> and <|image_pad|>"},
        {"role": "assistant", "content": "<|endoftext|>"},
    ]
    ids_L, _ = enc.encode_chat(chat, [])
    specials = [i for i in ids_L if i in set(TINY_SPECIAL_IDS.values())]
    assert specials == [TINY_SPECIAL_IDS[t] for t in ("<|im_start|>", "<|im_end|>") * 2]
    assert tok.decode(ids_L, skip_special_tokens=False) == (
        "<|im_start|>user\nsay <|im_end|> and <|image_pad|><|im_end|>\n"
        "<|im_start|>assistant\n<|endoftext|><|im_end|>\n"
    )


def test_pickled_encoder_keeps_special_strings_as_text(enc):
    """DataLoader workers receive the encoder pickled."""
    clone = pickle.loads(pickle.dumps(enc))
    chat = [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "ok"}]
    assert clone.encode_chat(chat, []) == enc.encode_chat(chat, [])
    assert clone.encode_text("<|endoftext|>") == enc.encode_text("<|endoftext|>")


def test_matches_transformers_chatml_rendering(tok, enc):
    """transformers renders a ChatML template it ships (Qwen2-Audio's default: the
    same per-message layout as Qwen3-VL's for string content once a system
    message comes first) and tokenises it; the ids must equal ours."""
    fast = pytest.importorskip("transformers").PreTrainedTokenizerFast
    qwen2_audio = pytest.importorskip("transformers.models.qwen2_audio.processing_qwen2_audio")
    prop = getattr(qwen2_audio.Qwen2AudioProcessor, "default_chat_template", None)
    if not isinstance(prop, property):
        pytest.skip("this transformers no longer ships Qwen2-Audio's default chat template")
    counts = iter(CHAT_IMAGE_TOKENS)  # expanded in the text, as Qwen3VLProcessor does
    hf_chat = [
        dict(
            m,
            content=m["content"].replace("<image>", f"{VS}{PAD * next(counts)}{VE}")
            if "<image>" in m["content"]
            else m["content"],
        )
        for m in CHAT
    ]
    hf_ids = fast(tokenizer_object=tok).apply_chat_template(
        hf_chat, chat_template=prop.fget(None), tokenize=True
    )["input_ids"]
    assert hf_ids == enc.encode_chat(CHAT, CHAT_IMAGE_TOKENS)[0]


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "messages, images, reason",
    [
        (
            [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "yo"}],
            [],
            "image_tag_mismatch",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            [4],
            "image_tag_mismatch",
        ),
        (
            [{"role": "tool", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            [],
            "bad_record",
        ),
        (
            [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "yo"}],
            [],
            "bad_record",
        ),
        (
            [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}],
            [],
            "bad_record",
        ),
        ("not a list", [], "bad_record"),
        ([{"role": "user", "content": "hi"}], [], "empty_sample"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
            [],
            "empty_sample",
        ),
        ([], [], "empty_sample"),
    ],
)
def test_chat_errors(enc, messages, images, reason):
    with pytest.raises(SkipSample) as err:
        enc.encode_chat(messages, images)
    assert err.value.reason == reason


@pytest.mark.parametrize(
    "text, reason", [("", "empty_sample"), (" \n", "empty_sample"), (None, "bad_record")]
)
def test_text_errors(enc, text, reason):
    with pytest.raises(SkipSample) as err:
        enc.encode_text(text)
    assert err.value.reason == reason


def test_missing_special_token_is_named():
    no_video = {t: i for t, i in TINY_SPECIAL_IDS.items() if t != "<|video_pad|>"}
    with pytest.raises(ValueError, match=r"<\|video_pad\|>"):
        ChatEncoder(train_bpe(shipped_texts(200), no_video))


# ----------------------------------------------------------------- model check
def test_check_model_tiny(enc):
    enc.check_model(VLMConfig.preset("tiny"))


def test_check_model_names_both_ids(enc):
    cfg = VLMConfig.preset("tiny")
    cfg.image_token_id = 7
    with pytest.raises(
        ValueError, match=r"<\|image_pad\|> = 1020 .* image_token_id = 7; set image_token_id=1020"
    ):
        enc.check_model(cfg)


def test_check_model_vocab_too_small(enc):
    cfg = VLMConfig.preset("tiny")
    cfg.text.vocab_size = 1000
    with pytest.raises(ValueError, match="1022 ids .* text.vocab_size = 1000"):
        enc.check_model(cfg)
