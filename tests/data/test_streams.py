"""Global streams: with data.streams fixed, the rows of the job do not depend on
the data-parallel size or num_workers, and a state saved on one layout resumes
exactly on another (the ranks' states merged)."""

import json

import pytest
from data_helpers import small_data_config

from moevlm.data.loader import build_loader
from moevlm.data.state import merge_states
from moevlm.data.streams import PackedDataset
from moevlm.model import VLMConfig

TINY = VLMConfig.preset("tiny")
L = 4


def loader(shards, world, rank=0, num_workers=0, streams=L):
    return build_loader(
        small_data_config(shards, streams=streams, num_workers=num_workers),
        TINY,
        rank=rank,
        world=world,
    )


def ids(ld, n):
    return [next(ld)["sample_ids"] for _ in range(n)]


def interleave(*ranks):
    return [row for rows in zip(*ranks) for row in rows]


def roundtrip(state):
    return json.loads(json.dumps(state))


@pytest.fixture(scope="module")
def reference(sample_shards):
    """The job's first 14 global rows, read by one rank with two worker processes."""
    return ids(loader(sample_shards, world=1, num_workers=2), 14)


def test_worker_serves_its_local_streams_in_cycling_order():
    """Rank 1 of 2 with L=8 owns streams 1, 3, 5, 7; the next row is due from local
    index 1 (stream 3).  Two workers: worker 0 takes 3, 7, 3, ...; worker 1 takes 5, 1,
    5, ...; taking one row from each worker in turn gives 3, 5, 7, 1, 3, ..."""
    ds = PackedDataset(None, [], {}, "", 0, 8, [1, 3, 5, 7], {}, offset=1)
    assert [ds.mine(p, 2) for p in (0, 1)] == [[3, 7], [5, 1]]
    assert ds.mine(0, 1) == [3, 5, 7, 1] and [ds.mine(p, 4) for p in range(4)] == [
        [3],
        [5],
        [7],
        [1],
    ]


def test_rows_do_not_depend_on_the_layout(sample_shards, reference):
    """Global row k of one rank (2 workers) is row k // 2 of rank k % 2 of two (1 worker each)."""
    rank0, rank1 = (ids(loader(sample_shards, world=2, rank=r, num_workers=1), 7) for r in (0, 1))
    assert interleave(rank0, rank1) == reference
    # no repeats
    assert len({sid for row in reference for sid in row}) == sum(len(row) for row in reference)


def test_resume_on_another_layout_continues_the_job(sample_shards, reference):
    """1 rank for 6 rows -> 2 ranks (2 workers each) for 2 rows each -> 1 rank (2 workers)
    for 4 rows: the same 14 rows as one rank uninterrupted."""
    first = loader(sample_shards, world=1)
    assert ids(first, 6) == reference[:6]
    saved = roundtrip(first.state_dict())
    assert saved["streams"] == L and sorted(saved["states"]) == ["0", "1", "2", "3"]
    ranks = [loader(sample_shards, world=2, rank=r, num_workers=2) for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(merge_states([saved]))
        assert r.offset == 1  # each rank's streams delivered 3 rows: the second of its two is due
    assert interleave(*(ids(r, 2) for r in ranks)) == reference[6:10]
    states = [roundtrip(r.state_dict()) for r in ranks]
    assert sorted(states[0]["states"]) == ["0", "2"] and sorted(states[1]["states"]) == ["1", "3"]
    last = loader(sample_shards, world=1, num_workers=2)
    last.load_state_dict(merge_states(states[::-1]))
    assert last.offset == 2  # 10 rows delivered: stream 2 is due
    assert ids(last, 4) == reference[10:]


def test_layouts_are_fitted_with_a_warning_or_refused_in_one_line(sample_shards, caplog):
    """Fewer workers (same rows), fewer streams than asked when the shards are too few (a divisor of the
    asked number: it depends on the shards only), a non-power-of-two dp under auto; refused only where no
    stream layout can work."""
    with pytest.raises(
        ValueError, match="data.streams=3 is not a multiple of the data-parallel size 2"
    ):
        loader(sample_shards, world=2, streams=3)
    caplog.set_level("WARNING", "moevlm.data.loader")
    assert loader(sample_shards, world=2, num_workers=4).workers == 2
    assert (
        "data.num_workers=4 lowered to 2: each data-parallel rank serves 2 streams" in caplog.text
    )
    # 23 shards: 24's largest divisor <= 23
    assert loader(sample_shards, world=1, streams=24).streams == 12
    assert (
        "23 shards cannot feed 24 data streams (each needs a shard): reading them as 12 streams"
        in caplog.text
    )
    assert loader(sample_shards, world=3, streams=0).streams == 15
    assert (
        "the 3 data-parallel ranks cannot share 16 streams evenly; reading 15 streams"
        in caplog.text
    )
    with pytest.raises(
        ValueError,
        match=r"23 shards cannot feed 8 data-parallel ranks with data.streams=24: they "
        r"give 12 streams, not a multiple of 8; rebuild .*img2dataset --number_sample_per_shard.*"
        r"\(at least 24 shards\)",
    ):
        loader(sample_shards, world=8, streams=24)
    with pytest.raises(
        ValueError,
        match=r"23 shards cannot feed 32 data-parallel ranks with data.streams=16 \(auto\)",
    ):
        loader(sample_shards, world=32, streams=0)
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        loader(sample_shards, world=2, rank=2)


def test_default_streams_give_the_same_rows_on_1_2_and_4_ranks(sample_shards):
    """data.streams and num_workers left at their defaults (16 streams, 2 workers): one rank, an FSDP-style
    dp=2 and dp=4 deliver the same 20 global rows (16 streams and 4 into the second round), and a state
    saved on dp=2 resumes on dp=1 (the saved stream count is the same)."""

    def default(world, rank=0, num_workers=2):
        return build_loader(
            small_data_config(sample_shards, num_workers=num_workers), TINY, rank=rank, world=world
        )

    one = default(1)
    want = ids(one, 20)
    assert one.streams == 16 and one.workers == 2
    dp2 = [default(2, r) for r in (0, 1)]
    assert interleave(*(ids(r, 10) for r in dp2)) == want
    assert interleave(*(ids(default(4, r), 5) for r in range(4))) == want
    again = default(1, num_workers=0)
    again.load_state_dict(merge_states([roundtrip(r.state_dict()) for r in dp2]))
    assert ids(again, 4) == ids(one, 4)


def test_merge_refuses_states_of_different_jobs_or_steps(sample_shards):
    a = loader(sample_shards, world=2, rank=0)
    next(a)
    s1 = a.state_dict()
    next(a), next(a)  # streams 2, then 0 again
    with pytest.raises(ValueError, match="different states for stream 0"):
        merge_states([s1, a.state_dict()])
    with pytest.raises(ValueError, match="different jobs"):
        merge_states([s1, {**s1, "seed": 5}])
    fresh = loader(sample_shards, world=2, rank=1)
    fresh.load_state_dict(s1)  # none of rank 1's streams in it: they start fresh
    assert fresh.states == {} and fresh.offset == 0
