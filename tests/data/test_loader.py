"""The loader on the real sample set: 2 ranks x 2 workers see every sample once
per epoch, micro-batches have one shape, and a resumed loader continues exactly."""

import json
import tarfile
from collections import Counter

import pytest
import torch
from data_helpers import small_data_config

from moevlm.data.loader import build_loader
from moevlm.model import VLMConfig

TINY = VLMConfig.preset("tiny")


def all_ids(folder):
    ids = []
    for path in sorted(folder.glob("shard-*.tar")):
        with tarfile.open(path) as tar:
            ids += [
                json.loads(tar.extractfile(m).read())["id"]
                for m in tar.getmembers()
                if m.name.endswith(".json")
            ]
    return ids


def shapes(batch):
    return {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)}


@pytest.mark.slow
def test_two_ranks_two_workers_read_every_sample_exactly_once_per_epoch(sample_shards):
    seen, firsts, seconds, shape_set, stats = Counter(), [], [], set(), []
    for rank in (0, 1):
        loader = build_loader(small_data_config(sample_shards, epochs=2), TINY, rank=rank, world=2)
        for batch in loader:
            for sid in batch["sample_ids"]:
                (seconds if seen[sid] else firsts).append(sid)
                seen[sid] += 1
            shape_set.add(tuple(sorted(shapes(batch).items())))
            assert batch["useful_tokens"] + batch["padded_tokens"] == 512
            assert batch["num_images"] == int((batch["image_grid_thw"].prod(-1) > 0).sum())
        stats.append(loader.stats())
    expected = Counter(all_ids(sample_shards))
    assert len(expected) == sum(expected.values()) > 300
    # nothing lost, nothing duplicated, in each epoch
    assert seen == Counter({sid: 2 for sid in expected})
    assert firsts != seconds  # the second epoch is reshuffled
    assert len(shape_set) == 1  # every micro-batch of the run has the same shapes
    assert all(s["skipped_total"] == 0 and s["epoch"] == 2 for s in stats), stats
    assert (
        sum(s["samples_packed"] for s in stats)
        == sum(s["samples_read"] for s in stats)
        == 2 * len(expected)
    )


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same_batches(a, b):
    assert [x["sample_ids"] for x in a] == [y["sample_ids"] for y in b]
    for x, y in zip(a, b):
        for k, v in x.items():
            if torch.is_tensor(v):
                assert torch.equal(v, y[k]), k


@pytest.mark.parametrize("vision_budget", ["off", "auto"])
def test_resume_continues_exactly_across_workers_and_epochs(sample_shards, vision_budget):
    """Four shards over two streams (one per worker): epochs end within the run,
    the shuffle buffer and the packer hold samples at the checkpoint, and the
    next batch is due from stream 1 (an odd number of batches was delivered).
    With the vision-FLOPs budget on too (it holds no state beyond the held samples)."""
    shards = ",".join(str(p) for p in sorted(sample_shards.glob("shard-*.tar"))[:4])
    cfg = small_data_config(shards, tokenizer=str(sample_shards / "tokenizer.json"), streams=2)
    cfg.pack.max_vision_flops = vision_budget
    first = build_loader(cfg, TINY)
    take(first, 7)
    state = first.state_dict()
    assert state["streams"] == 2 and [s["batches"] for s in state["states"].values()] == [4, 3]
    assert any(s["shuffle"] for s in state["states"].values()) and any(
        s["packer"] for s in state["states"].values()
    )
    expected = take(first, 30)
    assert first.stats()["epoch"] >= 1  # both workers went past an epoch boundary

    resumed = build_loader(cfg, TINY)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    assert_same_batches(take(resumed, 30), expected)
    assert resumed.stats()["samples_read"] == first.stats()["samples_read"]


def test_state_of_another_stream_count_or_seed_is_refused(sample_shards):
    """(Before the auto default was fixed at 16, data.streams=0 meant dp x workers: such a state saved 2.)"""
    cfg = small_data_config(sample_shards, num_workers=0, streams=2)
    state = build_loader(cfg, TINY, rank=0, world=1).state_dict()
    with pytest.raises(
        ValueError, match="streams saved 2 vs now 16.*set data.streams to the saved value"
    ):
        build_loader(
            small_data_config(sample_shards, num_workers=0), TINY, rank=0, world=2
        ).load_state_dict(state)
    with pytest.raises(ValueError, match="seed saved 1 vs now 2"):
        build_loader(
            small_data_config(sample_shards, num_workers=0, seed=2, streams=2), TINY
        ).load_state_dict(state)


def test_in_process_loader_and_config_errors(sample_shards):
    cfg = small_data_config(sample_shards, num_workers=0)
    batch = next(iter(build_loader(cfg, TINY)))
    assert batch["input_ids"].shape == (1, 512)
    bad = small_data_config(sample_shards)
    bad.image.max_pixels = 256 * 256
    with pytest.raises(ValueError, match="max_patches"):
        build_loader(bad, TINY)
    with pytest.raises(ValueError, match=r"\d+ shards cannot feed 32 data-parallel ranks"):
        build_loader(small_data_config(sample_shards), TINY, rank=0, world=32)
    other = VLMConfig.preset("tiny").replace(image_token_id=1000)
    with pytest.raises(ValueError, match="1000"):
        build_loader(small_data_config(sample_shards), other)


ORPHAN_SCRIPT = """
import sys, time
sys.path.insert(0, {helpers!r})
from data_helpers import small_data_config
from moevlm.data.loader import build_loader
from moevlm.model import VLMConfig

if __name__ == "__main__":
    loader = build_loader(small_data_config({shards!r}), VLMConfig.preset("tiny"))
    next(loader)
    print(*[w.pid for w in loader._it._workers], flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_workers_exit_when_the_training_process_is_killed(sample_shards, tmp_path):
    """SIGKILL of the trainer must not leave forkserver workers decoding for nobody."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "victim.py"
    script.write_text(
        ORPHAN_SCRIPT.format(helpers=str(Path(__file__).parent), shards=str(sample_shards))
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = (
        time.time() + 300
    )  # a hang bound: on a busy machine the fork server's exit takes seconds
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)
