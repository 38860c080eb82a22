"""moevlm's training entry point: compose the Hydra config, train, exit.

    python train.py                                        # embedded CPU default
    torchrun --nproc-per-node 8 train.py +experiment=h100_fsdp data.shards=DIR
    python train.py -m optim.lr=1e-3,3e-4                  # a sweep, one job each

Everything else lives in moevlm/train/ (config, trainer, checkpoint, metrics).
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from moevlm.model.config import ConfigError
from moevlm.model.hf import CheckpointError as HFCheckpointError
from moevlm.parallel import ParallelNotBuilt
from moevlm.train.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg) -> None:
    from moevlm.train.checkpoint import CheckpointError
    from moevlm.train.trainer import EXIT_CHECKPOINT, Trainer

    hc = HydraConfig.get()
    sweep = (hc.sweep.dir, hc.job.num) if hc.mode == RunMode.MULTIRUN else None
    try:
        trainer = Trainer(cfg, sweep=sweep)
    except (ConfigError, HFCheckpointError, ParallelNotBuilt) as err:
        print(f"config error: {err}", file=sys.stderr)  # it says what to change; a traceback would bury it
        sys.exit(2)
    except CheckpointError as err:  # train.resume names a checkpoint that is damaged or does not fit
        print(f"checkpoint error: {err}", file=sys.stderr)
        sys.exit(EXIT_CHECKPOINT)
    code = trainer.run()
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
