"""Token dispatchers behind one interface (`moevlm.model.dispatcher`; docs/dispatchers.md).

Present: `local` (EP=1), `alltoall` (expert parallel over a process group:
uneven all-to-all, dropless; EP=1 is exactly `local`; or with a capacity
factor, fixed-size buffers without host sync, overflow dropped and counted:
`capacity.py`), `deepep` (DeepEP's V2 `deep_ep.ElasticBuffer` or V1 `deep_ep.Buffer`, imported only
when used: `deepep.py`) and `hybridep` (`deep_ep.HybridEPBuffer` from DeepEP's hybrid-ep branch:
`hybridep.py`), both run here only against test emulators.  `availability.py` answers whether deepep /
hybridep could run here (the deep_ep package, the adapter, their layout rules) for config validation.
A plan builds deepep and hybridep as their models, without the package (`modelled.py`).
"""

from moevlm.dispatch.base import (
    DISPATCHERS,
    MODELS,
    DispatcherSpec,
    ModelledBuffers,
    TokenDispatcher,
    build_dispatcher,
    dense_routing,
    dispatcher_names,
    register_dispatcher,
)

from moevlm.dispatch.local import LocalDispatcher  # isort: skip
from moevlm.dispatch.alltoall import AllToAllDispatcher
from moevlm.dispatch.deepep import DeepEPDispatcher
from moevlm.dispatch.hybridep import HybridEPDispatcher
from moevlm.dispatch.modelled import ModelledDeepEP, ModelledHybridEP

__all__ = [
    "DISPATCHERS",
    "DispatcherSpec",
    "AllToAllDispatcher",
    "DeepEPDispatcher",
    "HybridEPDispatcher",
    "LocalDispatcher",
    "MODELS",
    "ModelledBuffers",
    "ModelledDeepEP",
    "ModelledHybridEP",
    "TokenDispatcher",
    "build_dispatcher",
    "dense_routing",
    "dispatcher_names",
    "register_dispatcher",
]
