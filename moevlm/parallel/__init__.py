"""Parallel folding: `ParallelDims` (mesh.py) and `parallelize` (parallelize.py).

The model in `moevlm.model` is built without any process group; this package
rewrites it: tensor + sequence parallel (tensor_parallel.py), expert and
expert-tensor parallel (expert_parallel.py, with moevlm.dispatch.alltoall),
FSDP2 or DDP-style data parallel and the cross-group gradient clipping
(data_parallel.py).  Context parallel and pipeline stages are refused with a
message until they are built.
"""

from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.parallelize import (ParallelContext, ParallelNotBuilt, copy_full_, full_grads, full_state_dict,
                                         full_tensor, init_parameters_, parallel_context, parallelize)

__all__ = ["ParallelContext", "ParallelDims", "ParallelNotBuilt", "copy_full_", "full_grads", "full_state_dict",
           "full_tensor", "init_parameters_", "parallel_context", "parallelize"]
