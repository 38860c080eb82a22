"""The signals that ask a run to stop, in one place: the trainer checkpoints after the current step on
any of them (moevlm.train.faults); the data loader's workers and fork server ignore them all
(moevlm.data.loader, moevlm.data.deaf).  Imports nothing but `signal`.

SIGTERM (schedulers, torchrun), SIGINT (Ctrl-C), SIGHUP (a closed terminal; torchrun forwards it),
SIGUSR1 (Slurm's warning before the time limit, --signal=USR1@secs), SIGQUIT (Ctrl-backslash).
"""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT)
