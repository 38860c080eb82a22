"""The machine a GPU suite ran on (bench/gpu_suite.sh's first step): versions, and on CUDA the two ceilings
every later figure is read against, measured on random data (never zeros, which run faster):

    ceiling: device copy   a 1 GiB bf16 device-to-device copy, bytes read + written per second
    ceiling: bf16 matmul   an 8192^3 bf16 matrix product, TFLOP/s

    python bench/gpu_env.py
"""

from __future__ import annotations

import platform

import torch


def _seconds(fn, n: int = 10) -> float:
    """Mean seconds of `fn()` over n runs after one warm-up, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / n


def main() -> None:
    cuda = torch.cuda.is_available()
    where = f" ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})" if cuda else ""
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA available {cuda}{where}"
    )
    for name in ("triton", "transformers", "hydra", "omegaconf", "webdataset", "tokenizers"):
        try:
            print(f"{name} {__import__(name).__version__}")
        except Exception as err:  # noqa: BLE001 - a missing optional package is reported, not fatal
            print(f"{name}: not importable ({type(err).__name__})")
    if not cuda:
        print("ceiling: none measured (no CUDA device)")
        return
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    s = _seconds(lambda: dst.copy_(src))
    print(
        f"ceiling: device copy {2 * src.numel() * 2 / s / 1e9:.0f} GB/s (read + write, 1 GiB bf16)"
    )
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    s = _seconds(lambda: a @ b)
    print(f"ceiling: bf16 matmul 8192^3 {2 * 8192**3 / s / 1e12:.0f} TFLOP/s (random data)")


if __name__ == "__main__":
    main()
