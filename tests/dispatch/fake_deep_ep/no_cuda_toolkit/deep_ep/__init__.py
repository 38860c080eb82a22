"""TEST DOUBLE, not DeepEP: DeepEP main's import-time check failing on a machine without a CUDA toolkit
(V2 compiles its kernels with nvcc at run time; see ../../README.md)."""

raise AssertionError("Cannot find CUDA root: set CUDA_HOME to a CUDA toolkit with nvcc")
