"""moevlm's training entry point: compose the Hydra config, train, exit.

    python train.py                                        # embedded CPU default
    torchrun --nproc-per-node 8 train.py +experiment=h100_fsdp data.shards=DIR
    python train.py -m optim.lr=1e-3,3e-4                  # a sweep, one job each (a failed one is recorded)

Everything else lives in moevlm/train/ (config, trainer, checkpoint, metrics).
Exit codes: moevlm.train.exit_codes.ExitCode and MEANINGS (0 done, 2 config error, ..., 70 a bug).
"""

import logging
import os
import signal
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from moevlm.config import check_overrides, compose_job
from moevlm.config.reference import register_configs, show_sections
from moevlm.errors import ConfigError
from moevlm.parallel import ParallelNotBuilt
from moevlm.signals import STOP_SIGNALS
from moevlm.train.exit_codes import ExitCode, bug_line
from moevlm.train.sweep import claimed_root, run_job, sweep_probes, sweep_root
from moevlm.train.torchrun_exit import config_error_exit

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg) -> None:
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        try:
            code = _job(cfg, None)
        except Exception as err:  # noqa: BLE001  (expected failures exit with their code inside _job)
            traceback.print_exc()
            print(bug_line(err), file=sys.stderr, flush=True)
            code = ExitCode.BUG
        # the run is over (checkpointed if it stopped early) and the process exits: a stop signal now,
        # such as torchrun's SIGTERM once another rank has exited, must not turn the code into -15.
        # Ignored, not handled: Python resets its own handlers to the default while it finalises.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _exit_now(code)
        if code:
            sys.exit(code)
        return
    # a sweep's job: its outcome is recorded and the sweep goes on (moevlm.train.sweep)
    # the root rank 0's SweepStatus claimed (a `-1` suffix if another sweep took Hydra's name); the
    # other ranks receive their run directory from rank 0 (setup.claim_run_dir)
    root = claimed_root() or sweep_root(cfg.train.run_dir, hc.sweep.dir)
    sweep = (str(root), hc.job.num)
    run_job(lambda: _job(cfg, sweep), root, hc.job.num, root / str(hc.job.num), hc.overrides.task)


def _exit_now(code: int) -> None:
    """A rank of a multi-process launch whose run has closed (checkpoint settled, loaders and logs
    closed, process group destroyed) exits without the interpreter's finalisation: there the
    communication library's threads can be torn down under it, which aborts a run that finished
    (gloo: `terminate called without an active exception`, SIGABRT, torchrun reports a failure)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _job(cfg, sweep: tuple[str, int] | None) -> int:
    """One job (the run, or one of a sweep): its exit code; set-up failures exit with theirs."""
    from moevlm.train.failures import CONFIG_LINES, SETUP, FailureContext, classify
    from moevlm.train.trainer import Trainer

    if cfg.parallel.fake_world:
        sys.exit(_plan(cfg))
    try:
        trainer = Trainer(cfg, sweep=sweep)
    # each failure class (moevlm.train.failures.FAILURES): one line, not a traceback, and its code
    except Exception as err:
        failure = classify(err, phase=SETUP, ctx=FailureContext(timeout_s=cfg.parallel.timeout_s))
        if failure.code == ExitCode.BUG:
            raise
        if failure.where == CONFIG_LINES:
            # torchrun's traceback too would bury the lines (torchrun_exit); a sweep's job fails alone
            # (recorded, the sweep goes on): its launch is not ended
            same = getattr(err, "same_on_every_rank", False)
            config_error_exit(failure.message.splitlines(), same, end_launch=sweep is None)
        failure.say()
        sys.exit(failure.code)
    return trainer.run()


def _plan(cfg) -> int:
    """parallel.fake_world=N: the job planned on N fake ranks and printed (moevlm.plan); nothing trains."""
    from moevlm.plan.report import format_plan, make_plan

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        _config_error(
            "parallel.fake_world plans in one process: launch it with python, not torchrun"
        )
    try:
        out = make_plan(cfg, cfg.parallel.fake_world, cfg.parallel.fake_gpu)
    except (ConfigError, ParallelNotBuilt, ValueError) as err:
        _config_error(*str(err).splitlines())
    print(format_plan(out))
    return ExitCode.OK if out["fits"] else ExitCode.DOES_NOT_FIT


def _check_command_line() -> None:
    """Mistakes in the command line as `config error:` lines and exit 2, before Hydra (which would print
    its own text and exit 1, the "loss did not fall" code): an override of a field the schema lacks
    (naming the nearest options), then anything composition refuses (a value of the wrong type, an
    unknown group choice, override syntax).  A sweep (-m) has each of its values composed once."""
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    sweep = any(a in ("-m", "--multirun") for a in sys.argv[1:])
    try:
        check_overrides(args)
        # (--help, --cfg and the like compose in Hydra's own way)
        if not any(a.startswith("--") and a != "--multirun" for a in sys.argv[1:]):
            for job in sweep_probes(args) if sweep else [args]:
                compose_job(job)
    except ConfigError as err:
        _config_error(str(err))
    except Exception as err:  # Hydra's and OmegaConf's refusals: their first line and the key
        lines = [x.strip() for x in str(err).splitlines() if x.strip()]
        cause = [x.strip() for x in str(err.__cause__ or "").splitlines() if x.strip()]
        _config_error(lines[0] if lines else type(err).__name__, cause[0] if cause else None)


TORCHRUN = (
    "launch with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank)"
)


def launch_problem(env=os.environ) -> str | None:
    """What is wrong with a launch's environment variables (torchrun's, or set by hand as srun scripts
    do), found before any process group waits for peers that cannot come: counts that are not whole
    numbers, RANK outside 0..WORLD_SIZE-1, several ranks without MASTER_ADDR / MASTER_PORT."""
    values = {}
    for name, least in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        text = env.get(name)
        if text is None:
            continue
        if not text.strip().isdigit() or int(text) < least:
            return f"{name}={text!r} is not a whole number >= {least}; {TORCHRUN}"
        values[name] = int(text)
    world, rank = values.get("WORLD_SIZE", 1), values.get("RANK", 0)
    if rank >= world:
        return f"RANK={rank} but WORLD_SIZE={world}: ranks are 0..{world - 1}; {TORCHRUN}"
    local, local_world = values.get("LOCAL_RANK", 0), values.get("LOCAL_WORLD_SIZE")
    if local_world is not None and local >= local_world:
        return f"LOCAL_RANK={local} but LOCAL_WORLD_SIZE={local_world}; {TORCHRUN}"
    if world > 1:
        missing = [n for n in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if missing:
            return (
                f"WORLD_SIZE={world} but {', '.join(missing[:-1])}{' and ' if len(missing) > 1 else ''}"
                f"{missing[-1]} {'is' if len(missing) == 1 else 'are'} "
                f"not set: the ranks could not find each other; {TORCHRUN}, or set them by hand "
                "(MASTER_ADDR and MASTER_PORT: rank 0's host and a free port)"
            )
        port = env["MASTER_PORT"]
        if not port.isdigit() or not 0 < int(port) < 65536:
            return f"MASTER_PORT={port!r} is not a port number (1..65535); {TORCHRUN}"
    return None


def _config_error(*lines: str | None) -> None:
    config_error_exit(["; ".join(x for x in lines if x)])


def _help_sections() -> None:
    """`--help SECTION ...` (or `--help all`): the words after the flag that are not overrides choose the
    sections listed in full (moevlm.config.reference); taken off the command line before Hydra reads it."""
    flag = next((a for a in ("--help", "-h") if a in sys.argv), None)
    if flag is None:
        return
    at, words = sys.argv.index(flag) + 1, []
    while at < len(sys.argv) and "=" not in sys.argv[at] and not sys.argv[at].startswith("-"):
        words.append(sys.argv.pop(at))
    try:
        show_sections(words)
    except ValueError as err:
        _config_error(str(err))


if __name__ == "__main__":
    if (problem := launch_problem()) is not None:  # each rank finds its own
        config_error_exit([problem], same_on_every_rank=False)
    _help_sections()
    _check_command_line()
    main()
