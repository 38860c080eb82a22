"""Token dispatchers behind one interface (see `base.py` and ../shared/DISPATCHERS.md).

Present: `local` (EP=1).  The parallel issue adds `alltoall` (+ allgather for
ETP); DeepEP and HybridEP adapters follow.
"""

from moevlm.dispatch.base import (
    DISPATCHERS,
    TokenDispatcher,
    build_dispatcher,
    dense_routing,
    register_dispatcher,
)
from moevlm.dispatch.local import LocalDispatcher

__all__ = ["DISPATCHERS", "LocalDispatcher", "TokenDispatcher", "build_dispatcher", "dense_routing",
           "register_dispatcher"]
