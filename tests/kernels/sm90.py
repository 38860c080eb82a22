"""Compiling Triton kernels for Hopper (sm_90) on a machine without a GPU: ptxas runs, nothing launches.
The interpreter (TRITON_INTERPRET=1, the CPU tests) never compiles, so this is what catches GPU-only compile
errors and lets the tests read the PTX.

    stdout = run_compile_script(__file__)       # the test: `python THIS_FILE --compile-sm90`, interpreter off
    c = compile_sm90(fn, sig, consts, 4, 3)     # in that script: one kernel variant; c.asm["ptx"], c.metadata
"""

import os
import subprocess
import sys


def run_compile_script(path: str) -> str:
    """Run `path --compile-sm90` in a fresh interpreter without TRITON_INTERPRET; its stdout (it must succeed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, path, "--compile-sm90"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def compile_sm90(
    fn,
    sig: dict,
    consts: dict,
    num_warps: int,
    num_stages: int | None = None,
    divisible: bool = False,
):
    """The @triton.jit function `fn` compiled for sm_90: `sig` the runtime arguments' types by name, `consts`
    the constexpr values; `divisible`: every runtime argument but E specialized as 16-divisible, as a launch
    with contiguous, aligned operands specializes it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{n: "constexpr" for n in consts}}
    attrs = {
        (fn.arg_names.index(n),): [["tt.divisibility", 16]]
        for n, t in sig.items()
        if divisible and t != "constexpr" and n != "E"
    }
    src = ASTSource(
        fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()}, attrs=attrs
    )
    options = (
        dict(num_warps=num_warps)
        if num_stages is None
        else dict(num_warps=num_warps, num_stages=num_stages)
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
