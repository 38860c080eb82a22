"""TEST DOUBLE, not DeepEP: a build whose CUDA extension cannot load here (see ../../README.md)."""

raise OSError("libnvshmem_host.so.3: cannot open shared object file: No such file or directory")
