"""moevlm.data.state: a stream's resumable state is typed in the loader and builtins in a checkpoint;
a state as the loader has written it since STATE_VERSION 3 reads back typed and writes back unchanged."""

import json

import pytest

from moevlm.data.reader import Pos, ReadAt
from moevlm.data.state import STATE_VERSION, DataIdentity, ShardTally, StreamState

# one stream's entry of a state_dict()["states"], as written to a checkpoint (a sample-set run, with a
# settled shard counted as unusable and a shard read to its end added by hand)
SAVED = {
    "stream": 3,
    "epoch": 0,
    "next": [1, 11],
    "shuffle": [[0, 1, 7], [0, 1, 9], [0, 1, 10], [0, 1, 2], [0, 1, 8], [0, 1, 4]],
    "draws": 4,
    "packer": [[0, 1, 0], [0, 1, 1]],
    "skipped": {"bad_image": 2},
    "read": 12,
    "packed": 2,
    "batches": 1,
    "tally": [[1, 11, 8, 3, 0], [2, 4, 0, 0, 1]],
    "epoch_unusable": 1,
    "shards_all_skipped": {"shard-000004.tar": 1},
    "data_checked": False,
    "image_samples": 1,
    "images_used": 1,
    "images_packed": 1,
    "videos_packed": 0,
    "images_checked": False,
    "over_vision_budget": 0,
}


def test_a_saved_stream_state_reads_back_typed_and_writes_back_unchanged():
    st = StreamState.from_dict(json.loads(json.dumps(SAVED)))
    assert st.next_read == ReadAt(shard=1, sample=11)
    assert st.shuffle[0] == Pos(epoch=0, shard=1, sample=7) and st.packer[1].sample == 1
    assert st.tally == {
        1: ShardTally(read=11, waiting=8, usable=3, done=False),
        2: ShardTally(read=4, waiting=0, usable=0, done=True),
    }
    assert st.to_dict() == SAVED
    assert json.dumps(st.to_dict(), sort_keys=True) == json.dumps(SAVED, sort_keys=True)


def test_a_state_without_the_later_keys_takes_their_fresh_values():
    early = {k: SAVED[k] for k in ("stream", "epoch", "next", "shuffle", "draws", "packer")}
    early |= {k: SAVED[k] for k in ("skipped", "read", "packed", "batches")}
    st = StreamState.from_dict(early)
    fresh = StreamState(stream=3).to_dict()
    assert st.to_dict() == {**fresh, **early}
    assert st.tally == {} and st.shards_all_skipped == {} and not st.images_checked


def test_a_fresh_state_has_every_key_of_the_checkpoint():
    assert StreamState(stream=5).to_dict() == {
        "stream": 5,
        "epoch": 0,
        "next": [0, 0],
        "shuffle": [],
        "draws": 0,
        "packer": [],
        "skipped": {},
        "read": 0,
        "packed": 0,
        "batches": 0,
        "tally": [],
        "epoch_unusable": 0,
        "shards_all_skipped": {},
        "data_checked": False,
        "image_samples": 0,
        "images_used": 0,
        "images_packed": 0,
        "videos_packed": 0,
        "images_checked": False,
        "over_vision_budget": 0,
    }


def test_the_header_names_the_data_and_refuses_another():
    files = [["shard-000000.tar", 10240, "0cdb3287e769feb2"]]
    ident = DataIdentity("70ecd3f1262038d4", files, seed=1, streams=4)
    head = ident.header()
    assert head == {
        "version": STATE_VERSION,
        "shards": "70ecd3f1262038d4",
        "seed": 1,
        "streams": 4,
        "files": files,
    }
    ident.check({**head, "states": {}})
    with pytest.raises(ValueError, match="seed saved 2 vs now 1"):
        ident.check({**head, "seed": 2})
    with pytest.raises(ValueError, match="version 1 is not one this loader reads"):
        ident.check({**head, "version": 1})
    with pytest.raises(ValueError, match="saved with data.mock=random_pixels"):
        ident.check({**head, "mock": "random_pixels"})
    assert DataIdentity("x", files, 1, 4, mock="image_free").header()["mock"] == "image_free"
