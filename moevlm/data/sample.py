"""The embedded default dataset: photographs and prose that installed packages ship, turned into
caption, chat and text records plus a small tokenizer; nothing is downloaded.

    photos = packaged_photos()            # [Photo(path, caption, source), ...]
    records = sample_records()            # what build_shards --sample writes
    tok = sample_tokenizer()              # byte-level BPE fitting the tiny preset

Records are the canonical forms (records.py) with absolute file paths in `images` (the builder
swaps them for tar member names); `videos` name the sample clips (moevlm.data.sample_video), made
from the photographs when the set is built.  The same installed packages give the same records.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from moevlm.data.sample_video import SAMPLE_CLIPS, make_sample_clips
from moevlm.data.text import (
    IMAGE_PLACEHOLDER,
    ROLES,
    TINY_SPECIAL_IDS,
    VIDEO_PLACEHOLDER,
    train_bpe,
)

DOC_MIN_CHARS, DOC_MAX_CHARS = 400, 2000
TEXT_RECORDS = 300  # plain-text records in sample_records()
TEXT_CHATS = 8  # text-only chats answered with a pydoc passage

_SOURCES = {"skimage": "scikit-image", "sklearn": "scikit-learn", "matplotlib": "matplotlib"}

# (import name, path inside the package, caption).  Order is the output order.
_PHOTOS = (
    (
        "skimage",
        "data/astronaut.png",
        "A portrait of NASA astronaut Eileen Collins in her orange launch suit, smiling, with her helmet at her "
        "side. An American flag and a model of the space shuttle stand behind her. She piloted the shuttle on "
        "mission STS-63 in 1995.",
    ),
    (
        "skimage",
        "data/camera.png",
        "A black-and-white photograph of a man in a dark coat looking through a camera mounted on a tripod. "
        "He stands on a lawn with buildings low on the horizon behind him.",
    ),
    (
        "skimage",
        "data/chelsea.png",
        "A close-up of Chelsea, a tabby cat, looking straight at the camera with wide yellow-green eyes. Her "
        "striped fur and white whiskers are sharp against a soft, blurred background.",
    ),
    (
        "skimage",
        "data/coffee.png",
        "A red cup of espresso on a matching red saucer, a small spoon beside it, on a wooden table. It was "
        "taken at the Pikolo Espresso Bar; the smooth round porcelain contrasts with the coarse grain of the wood.",
    ),
    (
        "skimage",
        "data/coins.png",
        "Ancient Greek coins from Pompeii laid out in neat rows on a grey background, photographed in black "
        "and white. The picture comes from the Brooklyn Museum's collection.",
    ),
    (
        "skimage",
        "data/rocket.jpg",
        "A SpaceX Falcon 9 rocket standing on its launch pad at Cape Canaveral under a deep blue evening sky, "
        "lit by floodlights between tall lightning towers. It carried the DSCOVR satellite into space.",
    ),
    (
        "skimage",
        "data/hubble_deep_field.jpg",
        "The Hubble eXtreme Deep Field: a tiny patch of black sky in which nearly every speck of light is a "
        "distant galaxy. It is the farthest look into the universe the Hubble Space Telescope has taken.",
    ),
    (
        "skimage",
        "data/moon.png",
        "A grey, low-contrast photograph of the Moon's surface, with a few small craters and darker patches "
        "of rough ground.",
    ),
    (
        "skimage",
        "data/motorcycle_left.png",
        "A red motorcycle parked in a workshop, with shelves of boxes and equipment behind it. It is the left "
        "view of a stereo pair from the Middlebury 2014 stereo benchmark.",
    ),
    (
        "skimage",
        "data/motorcycle_right.png",
        "The same red motorcycle in the workshop, seen by the right camera of the stereo pair; everything is "
        "shifted slightly sideways compared with the left view.",
    ),
    (
        "skimage",
        "data/retina.jpg",
        "A fundus photograph of a healthy human left eye: the orange-red retina fills a circle on a black "
        "background, with the bright optic disc near one side and blood vessels branching out from it.",
    ),
    (
        "skimage",
        "data/ihc.png",
        "A microscope view of colonic glands stained by immunohistochemistry. Brown DAB stain shows where the "
        "FHL2 protein is expressed, and blue hematoxylin colours the rest of the tissue.",
    ),
    (
        "skimage",
        "data/page.png",
        "A scanned book page headed 'Region-based segmentation', with a paragraph about marking the coins and "
        "the background and a line of Python code below it. The lighting is uneven across the page.",
    ),
    (
        "skimage",
        "data/text.png",
        "A grey photograph of a sheet of paper covered in handwritten mathematical symbols, taken at a steep "
        "angle so the lines run diagonally across the frame.",
    ),
    (
        "skimage",
        "data/clock_motion.png",
        "A wall clock photographed while the camera was moving sideways, so the round clock face is smeared "
        "into a horizontal blur.",
    ),
    (
        "skimage",
        "data/brick.png",
        "A brick wall seen at an angle in shades of grey: rows of long, narrow bricks separated by pale lines "
        "of mortar.",
    ),
    (
        "skimage",
        "data/grass.png",
        "A close-up of grass in black and white, a dense and tangled texture of thin blades.",
    ),
    (
        "skimage",
        "data/gravel.png",
        "Gravel seen from above in shades of grey: many small, angular stones packed closely together.",
    ),
    (
        "sklearn",
        "datasets/images/china.jpg",
        "A tall, many-tiered Chinese pavilion with red pillars and ornate green and gold eaves, rising above "
        "trees. A lake and a hazy sky stretch out behind it.",
    ),
    (
        "sklearn",
        "datasets/images/flower.jpg",
        "A single orange dahlia in full bloom, its many petals curled in tight rings, against dark green "
        "leaves.",
    ),
    (
        "matplotlib",
        "mpl-data/sample_data/grace_hopper.jpg",
        "A portrait of Grace Hopper, the American computer scientist and US Navy rear admiral, in her navy "
        "dress uniform.",
    ),
)

_QUESTIONS = (
    "Describe this image.",
    "What does this picture show?",
    "What can you see here?",
    "Write a short caption for this photo.",
    "Tell me about this image.",
    "What is in this photograph?",
)
_FOLLOW_UP = "Where does this image come from?"


@dataclass(frozen=True)
class Photo:
    path: Path
    caption: str
    source: str  # the package that ships the file, e.g. "scikit-image"

    @property
    def name(self) -> str:
        return self.path.stem


# --------------------------------------------------------------------- photos
def _package_dir(name: str) -> Path | None:
    """Where package `name` is installed, without importing it; None if absent."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def packaged_photos() -> list[Photo]:
    """The real photographs installed packages ship, with captions."""
    if _package_dir("skimage") is None:
        raise FileNotFoundError(
            "the sample photos come from scikit-image, which is not installed; "
            "`pip install scikit-image`"
        )
    photos = []
    for package, rel, caption in _PHOTOS:
        root = _package_dir(package)
        if root is not None and (root / rel).is_file():
            photos.append(Photo(root / rel, caption, _SOURCES[package]))
    if not photos:
        raise FileNotFoundError(
            "scikit-image is installed but ships none of its sample photos; reinstall it"
        )
    return photos


# ---------------------------------------------------------------------- texts
def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs; one longer than DOC_MAX_CHARS is cut at line ends."""
    out = []
    for para in re.split(r"\n[ \t]*\n", text):
        para = para.strip("\n")
        while len(para) > DOC_MAX_CHARS:
            cut = para.rfind("\n", 0, DOC_MAX_CHARS)
            cut = cut if cut > 0 else DOC_MAX_CHARS
            out.append(para[:cut])
            para = para[cut:].lstrip("\n")
        if para.strip():
            out.append(para)
    return out


def _split_topic(text: str) -> list[str]:
    """Consecutive paragraphs joined into documents of DOC_MIN..DOC_MAX characters."""
    docs, cur = [], ""
    for para in _paragraphs(text):
        if cur and len(cur) + 2 + len(para) > DOC_MAX_CHARS:
            docs.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= DOC_MIN_CHARS:
            docs.append(cur)
            cur = ""
    if cur and docs and len(docs[-1]) + 2 + len(cur) <= DOC_MAX_CHARS:
        docs[-1] += "\n\n" + cur
    elif cur:
        docs.append(cur)
    return docs


def _topic_docs() -> list[tuple[str, str]]:
    """(topic, document) for every document of Python's pydoc topics, in key order."""
    from pydoc_data.topics import topics

    return [(key, doc) for key in sorted(topics) for doc in _split_topic(topics[key])]


def _spread(items: list, n: int | None) -> list:
    """n items evenly spaced over `items` (all of them when n is None or too large)."""
    if n is None or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def shipped_texts(max_docs: int | None = None) -> list[str]:
    """Prose documents from Python's pydoc topics; `max_docs` picks evenly spaced ones."""
    return _spread([doc for _, doc in _topic_docs()], max_docs)


# -------------------------------------------------------------------- records
def _caption_record(photo: Photo) -> dict:
    return {"id": f"caption-{photo.name}", "images": [str(photo.path)], "caption": photo.caption}


def _chat_record(i: int, photo: Photo) -> dict:
    """One image, one question; every third photo gets a second turn."""
    messages = [
        {"role": "user", "content": f"{IMAGE_PLACEHOLDER}\n{_QUESTIONS[i % len(_QUESTIONS)]}"},
        {"role": "assistant", "content": photo.caption},
    ]
    if i % 3 == 0:
        messages += [
            {"role": "user", "content": _FOLLOW_UP},
            {
                "role": "assistant",
                "content": f"It is the file {photo.path.name} that ships with the "
                f"{photo.source} Python package.",
            },
        ]
    if i == 1:
        messages.insert(
            0, {"role": "system", "content": "You are a careful assistant who describes images."}
        )
    return {"id": f"chat-{photo.name}", "images": [str(photo.path)], "messages": messages}


def _pair_record(a: Photo, b: Photo) -> dict:
    """A chat about two images at once."""
    if {a.name, b.name} == {"motorcycle_left", "motorcycle_right"}:
        question, answer = (
            "How are these two pictures related?",
            "They are a stereo pair: the same red motorcycle in a workshop, photographed by two "
            "cameras a short distance apart, so the scene is shifted sideways from one to the other.",
        )
    else:
        question, answer = (
            "Describe both images.",
            f"The first image: {a.caption} The second image: {b.caption}",
        )
    content = f"{IMAGE_PLACEHOLDER}\n{IMAGE_PLACEHOLDER}\n{question}"
    return {
        "id": f"pair-{a.name}-{b.name}",
        "images": [str(a.path), str(b.path)],
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": answer},
        ],
    }


def _pairs(photos: list[Photo]) -> list[tuple[Photo, Photo]]:
    """The stereo pair (when shipped) and a few neighbouring pairs."""
    by_name = {p.name: p for p in photos}
    pairs = (
        [(by_name["motorcycle_left"], by_name["motorcycle_right"])]
        if {"motorcycle_left", "motorcycle_right"} <= by_name.keys()
        else []
    )
    return pairs + [(photos[i], photos[i + 1]) for i in range(0, min(len(photos) - 1, 8), 2)]


def _strip_heading(doc: str) -> tuple[str, str]:
    """(title, body) of a pydoc document whose first line is underlined with '*' or '='."""
    lines = doc.split("\n")
    if len(lines) > 2 and lines[1] and set(lines[1]) <= {"*", "="}:
        return lines[0], "\n".join(lines[2:]).strip("\n")
    return "", doc


def _text_chat_records() -> list[dict]:
    """Text-only chats: a question on a pydoc topic answered by its first passage."""
    first_docs: dict[str, str] = {}
    for topic, doc in _topic_docs():
        first_docs.setdefault(topic, doc)
    records = []
    for topic in _spread(sorted(first_docs), TEXT_CHATS):
        title, body = _strip_heading(first_docs[topic])
        question = f"Explain this part of the Python documentation: {title or topic}."
        records.append(
            {
                "id": f"textchat-{topic}",
                "images": [],
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": body},
                ],
            }
        )
    return records


def _clip_file(spec) -> str:
    return f"{spec.name}.{spec.container}"


_MOVES = {"pan": "pans slowly from left to right across", "zoom": "zooms slowly in on"}


def sample_video_records() -> list[dict]:
    """Chats over the sample clips: each clip alone, one clip beside its photograph, two clips."""
    photos = {p.path: p for p in packaged_photos()}
    paths = sample_photo_paths()

    def about(spec) -> str:
        photo = photos[paths[spec.photo % len(paths)]]
        return f"The camera {_MOVES[spec.motion]} a photograph: {photo.caption}"

    records = [
        _chat(f"video-{s.name}", [], [_clip_file(s)], "<video>\nWhat does the camera do?", about(s))
        for s in SAMPLE_CLIPS
    ]
    a, b, c = SAMPLE_CLIPS[0], SAMPLE_CLIPS[1], SAMPLE_CLIPS[3]
    photo = str(paths[a.photo % len(paths)])
    records.append(
        _chat(
            f"video-image-{a.name}",
            [photo],
            [_clip_file(a)],
            "<image>\n<video>\nWas the video filmed from this picture?",
            "Yes. " + about(a),
        )
    )
    records.append(
        _chat(
            f"videos-{b.name}-{c.name}",
            [],
            [_clip_file(b), _clip_file(c)],
            "<video>\n<video>\nHow do the two videos differ?",
            f"In the first, {about(b)[0].lower()}{about(b)[1:]} In the second, {about(c)[0].lower()}"
            f"{about(c)[1:]}",
        )
    )
    return records


def _chat(rid: str, images: list[str], videos: list[str], question: str, answer: str) -> dict:
    return {
        "id": rid,
        "images": images,
        "videos": videos,
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
    }


def sample_records() -> list[dict]:
    """Caption, chat and text records over the packaged photos and pydoc prose, chats over the
    sample clips."""
    photos = packaged_photos()
    records = [_caption_record(p) for p in photos]
    records += [_chat_record(i, p) for i, p in enumerate(photos)]
    records += [_pair_record(a, b) for a, b in _pairs(photos)]
    records += _text_chat_records()
    records += sample_video_records()
    records += [
        {"id": f"text-{i:05d}", "text": doc} for i, doc in enumerate(shipped_texts(TEXT_RECORDS))
    ]
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise RuntimeError(
            f"duplicate sample record ids: {sorted({i for i in ids if ids.count(i) > 1})}"
        )
    return records


def _record_texts(record: dict) -> list[str]:
    if "messages" in record:
        return [
            m["content"].replace(IMAGE_PLACEHOLDER, "").replace(VIDEO_PLACEHOLDER, "")
            for m in record["messages"]
        ]
    return [record["caption"]] if "caption" in record else [record["text"]]


def sample_tokenizer() -> Tokenizer:
    """A byte-level BPE over every sample text, special ids as the tiny preset expects."""
    texts = [f"{role}\n" for role in ROLES]
    texts += [t for r in sample_records() if "text" not in r for t in _record_texts(r)]
    return train_bpe(texts + shipped_texts(), TINY_SPECIAL_IDS)


# A fixed handful (RGB and one grey) the tests index by position.
_TEST_PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "hubble_deep_field.jpg",
    "camera.png",
)


def sample_photo_paths() -> list[Path]:
    """Seven scikit-image photographs in a fixed order (tests and examples use them)."""
    by_name = {p.path.name: p.path for p in packaged_photos() if p.source == "scikit-image"}
    paths = [by_name[n] for n in _TEST_PHOTOS if n in by_name]
    if not paths:
        raise FileNotFoundError(
            f"none of {_TEST_PHOTOS} found in scikit-image's data folder; reinstall it"
        )
    return paths


def write_sample_clips(out_dir: Path) -> list[Path]:
    """The clips the video records name (SAMPLE_CLIPS over sample_photo_paths) into `out_dir`."""
    return make_sample_clips(sample_photo_paths(), out_dir)
