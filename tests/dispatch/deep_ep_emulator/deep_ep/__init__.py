"""TEST EMULATOR, not DeepEP: a `deep_ep` package over torch.distributed (gloo on the CPU) for moevlm's
adapter tests, laid out as upstream's (DeepEP main v2.1): the V1 API (`Buffer`, `legacy.py`) and the V2
API (`ElasticBuffer`, `elastic.py`).  See ../README.md for what each follows and what it does not emulate.
"""

import torch

from .elastic import ElasticBuffer, EPHandle, EventOverlap
from .legacy import Buffer, Config

__version__ = "emulator"
topk_idx_t = torch.int64
EMULATOR = True  # lets a test tell this double from a real build

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventOverlap", "topk_idx_t"]
