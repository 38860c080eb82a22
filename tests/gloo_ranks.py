"""Run a check on N gloo ranks in one launch (CPU, spawn, file rendezvous).

    run_ranks(my_checks, 4, tmp_path, extra_arg)   # my_checks(rank, extra_arg) on every rank

`my_checks` must be a module-level function (it is pickled to the ranks).  An
exception on any rank fails the launch with that rank's traceback.
"""

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(check, world: int, tmp_path, *args, timeout_s: int = 120) -> None:
    mp.spawn(
        _rank, args=(check, world, str(tmp_path / "rdzv"), args, timeout_s), nprocs=world, join=True
    )


def _rank(rank: int, check, world: int, init_file: str, args: tuple, timeout_s: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        torch.set_num_threads(1)  # N ranks share 2 cores
        check(rank, *args)
    finally:
        dist.destroy_process_group()
    # Leave without interpreter finalization: a gloo worker thread may still be releasing the last
    # collective's tensors, which takes the GIL, and a thread doing so while Python finalizes aborts
    # the rank with SIGABRT ("terminate called without an active exception").  An exception above
    # still reaches mp.spawn's error queue (it never gets here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_max_over_ranks(values: dict, out: str) -> None:
    """Every rank's `values` (name -> float, the same names everywhere), their max over the world written
    by rank 0 to `out` as JSON (read back with `json.loads`)."""
    t = torch.tensor([values[k] for k in sorted(values)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(dict(zip(sorted(values), t.tolist()))))
