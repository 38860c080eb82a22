"""Shards rewritten shorter between a checkpoint and its resume: the samples the shuffle buffer and the
packer held there are gone.  data.allow_changed_shards=true skips them (counted as gone_on_resume, one
warning) and goes on; without it the data cannot resume: DataError (the trainer's exit 8) naming the
option."""

import io
import json
import logging
import tarfile

import pytest
from test_loader_guards import TINY, shard_copy

from moevlm.data.errors import DataError
from moevlm.data.loader import build_loader

KEEP = 2  # samples each shard keeps


def keep_first_samples(path, n: int) -> None:
    """Rewrite a tar shard with the members of its first `n` samples only."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]
    keys = list(dict.fromkeys(m.name.split(".", 1)[0] for m, _ in members))[:n]
    with tarfile.open(path, "w") as tar:
        for m, data in members:
            if m.name.split(".", 1)[0] in keys:
                tar.addfile(m, io.BytesIO(data))


def test_samples_gone_since_the_checkpoint_are_skipped_or_refused(sample_shards, tmp_path, caplog):
    cfg = shard_copy(sample_shards, tmp_path)
    first = build_loader(cfg, TINY)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    # per stream: the positions held at the checkpoint that the rewritten shards no longer hold
    gone = {
        s: [p for p in st["shuffle"] + st["packer"] if p[2] >= KEEP]
        for s, st in state["states"].items()
    }
    assert sum(map(len, gone.values())) > 0
    for shard in sorted(tmp_path.glob("shard-*.tar")):
        keep_first_samples(shard, KEEP)

    # a state that cannot tell the shards changed (saved before shard fingerprints): the gone samples
    # stop the data, naming the option that continues
    old = {k: v for k, v in state.items() if k != "files"} | {"version": 2}
    blind = build_loader(cfg, TINY)
    blind.load_state_dict(old)
    with pytest.raises(
        DataError, match=r"are gone from their shards.*data.allow_changed_shards=true"
    ):
        next(blind)
    blind.close()

    # the option: the gone samples are skipped and counted, one warning, and the data goes on
    cfg.allow_changed_shards = True
    resumed = build_loader(cfg, TINY)
    with caplog.at_level(logging.WARNING, logger="moevlm.data.loader"):
        resumed.load_state_dict(state)
        for _ in range(8):  # rows of every stream (round robin over 4)
            assert next(resumed)["num_samples"] > 0
    said = [r.getMessage() for r in caplog.records if "gone from their shards" in r.getMessage()]
    # one line per stream that lost samples, with its count
    assert sorted(line.split(" (shuffle")[0] for line in said) == sorted(
        f"data stream {s}: {len(g)} sample(s) held at the checkpoint" for s, g in gone.items() if g
    )
    assert all(line.endswith("counted as gone_on_resume") for line in said)
    assert resumed.stats()["skipped"]["gone_on_resume"] == sum(map(len, gone.values()))
    resumed.close()
