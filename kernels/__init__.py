"""moevlm.kernels: the MoE and FP8 kernels, each Triton kernel beside its torch reference.

    grouped_gemm.py  (+ _triton)   grouped GEMM backends (loop, torch._grouped_mm, triton): `grouped_mm`
    permute.py                     fused permute / unpermute of top-k routed rows (torch or triton)
    fp8_quant.py  (+ _ref, _triton)            blockwise and MXFP8 quantization
    fp8_gemm.py   (+ _ref, _triton, _torch)    FP8 grouped and dense GEMMs: forward, dgrad, wgrad
    _common.py                     the one triton import, interpreter detection, launch sizes, checks

Installed as `moevlm.kernels` (pyproject `package-dir`): a top-level import name `kernels` belongs
to another PyPI package.  triton is optional: without it the torch backends run and asking for a
Triton one names the package.
"""

from moevlm.kernels.grouped_gemm import GROUPED_GEMMS, grouped_mm, grouped_mm_loop

# what other packages import from the package itself (moevlm.model.config, bench, tests)
__all__ = ["GROUPED_GEMMS", "grouped_mm", "grouped_mm_loop"]
