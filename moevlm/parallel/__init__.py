"""Parallel folding: `ParallelDims` (mesh.py) and `parallelize` (parallelize.py).

The model in `moevlm.model` is built without any process group; this package
rewrites it: tensor + sequence parallel (tensor_parallel.py), expert and
expert-tensor parallel (expert_parallel.py, with moevlm.dispatch.alltoall),
FSDP2 or DDP-style data parallel and the cross-group gradient clipping
(data_parallel.py), pipeline stages (pipeline_plan.py: the split and the
schedule's rules; pipeline.py: stage modules on torch.distributed.pipelining),
and Hugging Face checkpoints in and out of a laid-out model (hf_io.py).
Context parallel is refused with a message until it is built.
"""

from moevlm.parallel.hf_io import load_hf_weights_, save_hf
from moevlm.parallel.mesh import ParallelDims
from moevlm.parallel.parallelize import (ParallelContext, ParallelNotBuilt, copy_full_, full_grads, full_state_dict,
                                         full_tensor, init_parameters_, materialize_, parallel_context, parallelize)
from moevlm.parallel.pipeline_plan import PipelinePlan, plan_pipeline

__all__ = ["ParallelContext", "ParallelDims", "ParallelNotBuilt", "PipelinePlan", "copy_full_", "full_grads",
           "full_state_dict", "full_tensor", "init_parameters_", "load_hf_weights_", "materialize_",
           "parallel_context", "parallelize", "plan_pipeline", "save_hf"]
