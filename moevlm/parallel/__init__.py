"""Parallel folding: `ParallelDims` (mesh.py) and `build_model` (build.py).

The model in `moevlm.model` is built without any process group; `build_model` builds it for a
layout: the strategies its modules receive (tensor + sequence parallel: tensor_parallel.py; context
parallel: context_parallel.py; expert and expert-tensor parallel: expert_parallel.py, with the
dispatchers of moevlm.dispatch; the overlapped experts runner: ep_overlap.py), the weight placements,
recompute (recompute.py), activation offload to host memory (offload.py), per-block compile
(compile.py), FSDP2 or DDP-style data parallel and the cross-group gradient clipping
(data_parallel.py), CUDA-graph regions (cuda_graphs.py), pipeline
stages (pipeline_split.py: the split and the schedule's rules; pipeline.py: stage modules on
torch.distributed.pipelining); Hugging Face checkpoints in and out of a laid-out model (hf_io.py);
layout-independent initialization and unsharded values (weights.py).
"""

from moevlm.exports import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            ("ParallelContext", "ParallelNotBuilt", "build_model", "materialize_"),
            "moevlm.parallel.build",
        ),
        **dict.fromkeys(("load_hf_weights_", "save_hf"), "moevlm.parallel.hf_io"),
        "ParallelDims": "moevlm.parallel.mesh",
        **dict.fromkeys(("PipelineSplit", "split_pipeline"), "moevlm.parallel.pipeline_split"),
        **dict.fromkeys(
            ("copy_full_", "full_grads", "full_state_dict", "full_tensor", "init_parameters_"),
            "moevlm.parallel.weights",
        ),
    },
)

__all__ = [
    "ParallelContext",
    "ParallelDims",
    "ParallelNotBuilt",
    "PipelineSplit",
    "build_model",
    "copy_full_",
    "full_grads",
    "full_state_dict",
    "full_tensor",
    "init_parameters_",
    "load_hf_weights_",
    "materialize_",
    "split_pipeline",
    "save_hf",
]
