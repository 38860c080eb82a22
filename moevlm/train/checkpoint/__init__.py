"""Training checkpoints on torch.distributed.checkpoint (DCP) (why: docs/architecture.md).

ckpt = CheckpointManager(run_dir / "checkpoints", keep=3, async_save=False)
ckpt.save(step, model=model, optimizer=opt, extra={"scheduler": sched},
          per_rank={"data": loader.state_dict(), "rng": rng_state()})
if (path := ckpt.newest_verified()) is not None:
    got = ckpt.load(path, model=model, optimizer=opt, extra={"scheduler": sched},
                    per_rank=["rng"])
    step = got["step"]; set_rng_state(got["per_rank"]["rng"])
    data_states = ckpt.load_all_ranks(path, "data")   # every saved rank's value
ckpt.wait(); ckpt.close()      # async_save: the write in flight, then the background thread
"""

from moevlm.train.checkpoint.dcp_io import HOLD_ENV
from moevlm.train.checkpoint.manager import CheckpointManager
from moevlm.train.checkpoint.marker import FORMAT, MARKER, read_marker
from moevlm.train.checkpoint.rng import rng_state, set_rng_state
from moevlm.train.integrity import CheckpointError

__all__ = [
    "FORMAT",
    "HOLD_ENV",
    "MARKER",
    "CheckpointError",
    "CheckpointManager",
    "read_marker",
    "rng_state",
    "set_rng_state",
]
