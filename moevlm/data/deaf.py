"""Imported first by the data loader's fork server (its preload list): the server, and so every worker it
forks, ignores the stop signals that reach the whole process group, while the training process keeps its
own handlers throughout (a signal sent while the server starts is never lost).  Imports nothing else
(moevlm.signals holds only the list)."""

import signal

from moevlm.signals import STOP_SIGNALS

for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
