"""TEST DOUBLE, not DeepEP: DeepEP main's import-time check failing, as when torch's NCCL is not the one
DeepEP was linked against (see ../../README.md)."""

raise AssertionError("NCCL version mismatch: torch uses 2.27.5, DeepEP was built with 2.30.4")
