"""normalize_record / parse_json_bytes: every accepted form, the <image> tag
rule, and each way a record is rejected."""

import copy

import pytest

from moevlm.data.errors import SkipSample
from moevlm.data.records import Record, normalize_record, parse_json_bytes


def reason(obj, **kw) -> str:
    with pytest.raises(SkipSample) as e:
        normalize_record(obj, **kw)
    return e.value.reason


CANONICAL = [
    {
        "id": "c.1",
        "images": ["img0.jpg", "img1.png"],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "<image> and <image>: differences?"},
            {"role": "assistant", "content": "Colour."},
        ],
    },
    {
        "id": "c.2",
        "images": [],
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
    },
    {"id": "c.3", "images": ["img0.jpg"], "caption": "A cat on a mat."},
    {"id": "c.4", "text": "Plain text, no images."},
]


@pytest.mark.parametrize("obj", CANONICAL, ids=lambda o: o["id"])
def test_canonical_forms_round_trip(obj):
    rec = normalize_record(obj)
    assert rec.canonical() == obj
    assert normalize_record(rec.canonical()).canonical() == obj


def test_kinds():
    assert [normalize_record(o).kind for o in CANONICAL] == ["chat", "chat", "caption", "text"]


def test_llava_multi_turn_two_images():
    obj = {
        "id": 7,
        "image": ["a.jpg", "b.jpg"],
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "<image>\n<image>\nCompare them."},
            {"from": "gpt", "value": "The first is red."},
            {"from": "human", "value": "And the second?"},
            {"from": "gpt", "value": "Blue."},
        ],
    }
    rec = normalize_record(obj)
    assert rec == Record(
        "7",
        ["a.jpg", "b.jpg"],
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "<image>\n<image>\nCompare them."},
            {"role": "assistant", "content": "The first is red."},
            {"role": "user", "content": "And the second?"},
            {"role": "assistant", "content": "Blue."},
        ],
        None,
    )


def test_llava_untagged_images_prepended_to_first_user_turn():
    obj = {
        "id": "x",
        "image": ["a.jpg", "b.jpg"],
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "What?"},
            {"from": "gpt", "value": "Two."},
        ],
    }
    before = copy.deepcopy(obj)
    rec = normalize_record(obj)
    assert [m["content"] for m in rec.messages] == ["sys", "<image>\n<image>\nWhat?", "Two."]
    assert obj == before  # input untouched


def test_llava_text_only_chat_and_single_image_string():
    turns = [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]
    rec = normalize_record({"id": "t", "conversations": turns})
    assert (
        rec.kind == "chat"
        and rec.images == []
        and rec.messages[1] == {"role": "assistant", "content": "4"}
    )
    rec = normalize_record(
        {"id": "s", "image": "a.jpg", "conversations": [{"from": "human", "value": "<image>Hi"}]}
    )
    assert rec.images == ["a.jpg"] and rec.messages[0]["content"] == "<image>Hi"


def test_caption_forms_and_prompt():
    rec = normalize_record({"image": "cat.jpg", "caption": "A cat."}, default_id="caps.jsonl:3")
    assert rec.id == "caps.jsonl:3" and rec.kind == "caption" and rec.caption == "A cat."
    assert rec.messages == [
        {"role": "user", "content": "<image>"},
        {"role": "assistant", "content": "A cat."},
    ]
    rec = normalize_record(
        {"image": "cat.jpg", "caption": "A cat."}, default_id="k", caption_prompt="Describe."
    )
    assert rec.messages[0] == {"role": "user", "content": "<image>\nDescribe."}
    assert rec.canonical() == {
        "id": "k",
        "images": ["cat.jpg"],
        "caption": "A cat.",
    }  # prompt not stored


def test_text_key_is_a_caption_with_an_image_and_text_without():
    assert normalize_record({"image": "a.jpg", "text": "A cat."}, default_id="k").kind == "caption"
    rec = normalize_record({"text": "Just text."}, default_id="k")
    assert (
        rec.kind == "text"
        and rec.text == "Just text."
        and rec.messages is None
        and rec.images == []
    )


def test_first_key_decides_and_extra_keys_are_ignored():
    rec = normalize_record(
        {
            "id": "m",
            "conversations": [{"from": "human", "value": "q"}],
            "caption": "meta",
            "source": "coco",
        }
    )
    assert rec.kind == "chat"


@pytest.mark.parametrize(
    "obj",
    [
        {"id": "a", "conversations": [{"from": "human", "value": "<image>"}]},  # tag, no image
        {
            "id": "a",
            "image": ["a", "b", "c"],
            "conversations": [{"from": "human", "value": "<image><image>"}],
        },
        {
            "id": "a",
            "image": "a",
            "conversations": [
                {"from": "human", "value": "<image>"},
                {"from": "gpt", "value": "<image>"},
            ],
        },
        {"id": "a", "image": "a", "caption": "see <image>"},
        {"id": "a", "text": "html <image> tag"},
    ],
)
def test_image_tag_mismatch(obj):
    assert reason(obj) == "image_tag_mismatch"


@pytest.mark.parametrize(
    "obj, what",
    [
        ("a string", "not a dict"),
        ({"id": "a", "conversations": []}, "empty conversation"),
        ({"id": "a", "conversations": "hi"}, "conversation not a list"),
        ({"id": "a", "conversations": [{"from": "robot", "value": "x"}]}, "unknown role"),
        ({"id": "a", "conversations": [{"from": ["human"], "value": "x"}]}, "unhashable role"),
        ({"id": "a", "conversations": ["hi"]}, "turn not a dict"),
        ({"id": "a", "conversations": [{"from": "human", "value": 3}]}, "content not a string"),
        ({"id": "a", "conversations": [{"from": "human"}]}, "content missing"),
        (
            {"id": "a", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "content list",
        ),
        ({"id": "a", "image": "a.jpg", "images": ["a.jpg"], "caption": "x"}, "image and images"),
        ({"id": "a", "image": 5, "caption": "x"}, "image not a string"),
        ({"id": "a", "images": ["ok.jpg", ""], "caption": "x"}, "empty image path"),
        ({"id": "a", "caption": "x"}, "caption without image"),
        ({"id": "a", "caption": None, "image": "a.jpg"}, "caption not a string"),
        ({"id": "a", "image": "a.jpg"}, "no text at all"),
        ({"id": ["a"], "text": "x"}, "id a list"),
        ({"id": True, "text": "x"}, "id a bool"),
        ({"text": "x"}, "no id and no default"),
    ],
)
def test_bad_record(obj, what):
    assert reason(obj) == "bad_record", what


def test_detail_says_what_is_wrong():
    with pytest.raises(SkipSample, match="role 'robot'"):
        normalize_record({"id": "a", "conversations": [{"from": "robot", "value": "x"}]})


def test_lone_surrogate_is_bad_text_encoding():
    obj = parse_json_bytes(b'{"id": "a", "text": "bad \\ud800 half"}')
    assert reason(obj) == "bad_text_encoding"


def test_parse_json_bytes():
    assert parse_json_bytes('{"id": "é"}'.encode()) == {"id": "é"}
    assert parse_json_bytes(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # BOM
    for raw, why in [
        (b'{"a": "\xff"}', "bad_text_encoding"),
        (b'{"a": ', "bad_json"),
        (b"[1, 2]", "bad_json"),
        (b"", "bad_json"),
        (b"[" * 100_000, "bad_json"),
    ]:
        with pytest.raises(SkipSample) as e:
            parse_json_bytes(raw)
        assert e.value.reason == why, raw[:10]
