"""Parallel folding (ParallelDims, TP/SP, EP/ETP, CP, PP, FSDP2/DDP, `parallelize`).

Filled by the parallel-folding issue; the model in `moevlm.model` is built
without any process group, and this package rewrites it.
"""
