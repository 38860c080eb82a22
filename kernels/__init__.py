"""moevlm.kernels: the grouped GEMM (and, with the kernels issue, Triton kernels
for it and for permute/unpermute), each beside its torch reference.

Installed as `moevlm.kernels` (pyproject `package-dir`): a top-level import name
`kernels` belongs to another PyPI package.
"""

from moevlm.kernels.grouped_gemm import GROUPED_GEMMS, grouped_mm, grouped_mm_loop, grouped_mm_torch

__all__ = ["GROUPED_GEMMS", "grouped_mm", "grouped_mm_loop", "grouped_mm_torch"]
