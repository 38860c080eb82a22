"""Parallel folding: `ParallelDims` (mesh.py) and `parallelize` (parallelize.py).

The model in `moevlm.model` is built without any process group; this package
rewrites it.  TP/SP, EP/ETP, CP, PP and FSDP2/DDP arrive with the
parallel-folding issue.
"""

from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.parallelize import ParallelNotBuilt, parallelize

__all__ = ["ParallelDims", "ParallelNotBuilt", "parallelize"]
