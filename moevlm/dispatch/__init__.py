"""Token dispatchers behind one interface (see `base.py` and ../shared/DISPATCHERS.md).

Present: `local` (EP=1) and `alltoall` (expert parallel over a process group:
uneven all-to-all, dropless; EP=1 is exactly `local`; or with a capacity
factor, fixed-size buffers without host sync, overflow dropped and counted:
`capacity.py`).  Still to come: the ETP all-gather/reduce-scatter, DeepEP and HybridEP adapters;
`availability.py` already answers whether they could run here (the deep_ep package, the adapter, their
layout rules) for config validation.
"""

from moevlm.dispatch.base import (
    DISPATCHERS,
    TokenDispatcher,
    build_dispatcher,
    dense_routing,
    register_dispatcher,
)
from moevlm.dispatch.alltoall import AllToAllDispatcher
from moevlm.dispatch.local import LocalDispatcher

__all__ = ["DISPATCHERS", "AllToAllDispatcher", "LocalDispatcher", "TokenDispatcher", "build_dispatcher", "dense_routing",
           "register_dispatcher"]
