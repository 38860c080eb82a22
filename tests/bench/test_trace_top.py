"""bench/trace_top.py: a trace's device time by kind, by the step's parts and by kernel, and the idle
time between kernels; a CPU trace lists the parts' host times."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import trace_top  # noqa: E402


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


# a device timeline in microseconds: two parts side by side, one range nested in the second
# (moevlm.experts inside moevlm.forward_block), and a kernel outside every part
EVENTS = [
    _x("gpu_user_annotation", "moevlm.attention", 0, 100),
    _x("gpu_user_annotation", "moevlm.forward_block", 100, 200),
    _x("gpu_user_annotation", "moevlm.experts", 150, 100),
    _x("kernel", "flash_fwd_kernel<128>", 10, 60),
    _x("kernel", "void at::native::vectorized_elementwise_kernel<4>", 80, 20),
    _x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 160, 50),  # overlaps the next one
    _x(
        "kernel", "_grouped_gemm_triton_kernel", 200, 40
    ),  # a matrix product: gemm is matched before triton
    _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 260, 20),
    _x(
        "kernel", "ncclDevKernel_AllReduce_Sum_f32", 400, 100
    ),  # outside every part, after 120 us idle
    _x("user_annotation", "moevlm.attention", 0, 5),  # host side: not the device timeline
    {"ph": "M", "name": "process_name", "pid": 0},
]


def test_kernels_belong_to_the_host_range_open_at_their_launch():
    """Backward's kernels: launched by autograd's thread (tid 9) while the main thread (tid 7) waits
    in moevlm.backward, whose device-timeline range is empty; a kernel without its launch in the
    trace falls back to the device ranges."""

    def launch(ts, corr, tid=9):
        e = _x("cuda_runtime", "cudaLaunchKernel", ts, 2)
        e["tid"], e["args"] = tid, {"correlation": corr}
        return e

    def kernel(name, ts, dur, corr=None):
        e = _x("kernel", name, ts, dur)
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        _x("user_annotation", "moevlm.backward", 1000, 500),
        _x("user_annotation", "moevlm.attention", 100, 50),
        _x(
            "gpu_user_annotation", "moevlm.backward", 1100, 1
        ),  # the main thread's own launches only
        _x("gpu_user_annotation", "moevlm.optimizer", 3000, 100),
        launch(1010, 1),
        launch(1200, 2),
        launch(120, 3, tid=7),
        kernel("flash_bwd", 1600, 80, corr=1),  # runs after the host range closed: still backward
        kernel("sm90_gemm_bwd", 1700, 20, corr=2),
        kernel("flash_fwd", 130, 10, corr=3),
        kernel("multi_tensor_apply_kernel", 3010, 30),  # no launch: the device range
    ]
    lines = trace_top.summarize(events).splitlines()
    table = lines[lines.index("| part | device ms | % of device time |") + 2 :]
    table = table[: next(i for i, line in enumerate(table) if line.startswith("| kernel |"))]
    part = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in table}
    assert part["backward"] == "0.10" and part["attention"] == "0.01"
    assert part["optimizer"] == "0.03" and "(outside the parts)" not in part


def test_device_time_by_kind_part_and_kernel(tmp_path, capsys):
    text = trace_top.summarize(EVENTS, top=3)
    lines = text.splitlines()
    # span 0..500 from the first kernel (10) to the last end (500): 490; busy = 60+20+(160..240)+20+100
    assert lines[0].startswith("device span 0.49 ms, busy 0.28 ms (57.1%), idle 0.21 ms; 6 device")
    assert "summing to 0.29 ms" in lines[0]  # 60+20+50+40+20+100, the overlap counted twice
    tables = {}  # first header cell -> {first cell: the other cells}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|---"):
            continue
        if cells[0] in ("kind", "part", "kernel"):
            head = tables.setdefault(cells[0], {})
        else:
            head[cells[0]] = cells[1:]
    kinds, parts = tables["kind"], tables["part"]
    assert kinds["matrix product"][0] == "0.09"  # the xmma gemm and the triton grouped gemm
    assert kinds["attention"][0] == "0.06" and kinds["elementwise"][0] == "0.02"
    assert kinds["communication"][0] == "0.10" and kinds["copy / memset"][0] == "0.02"
    assert parts["experts"][0] == "0.09"  # both GEMMs start inside the nested range
    assert parts["forward_block"][0] == "0.02"  # the copy: the outer range only
    assert parts["attention"][0] == "0.08"  # flash + the elementwise kernel
    assert parts["(outside the parts)"][0] == "0.10"
    assert list(tables["kernel"]) == [
        "ncclDevKernel_AllReduce_Sum_f32",
        "flash_fwd_kernel<128>",
        "sm90_xmma_gemm_bf16bf16_bf16f32",
    ]
    assert tables["kernel"]["flash_fwd_kernel<128>"] == ["1", "0.06", "20.7"]  # 60 of 290 us
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert trace_top.main([str(path), "--top", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == lines[0]
    assert trace_top.main([str(tmp_path / "missing.json")]) == 2


def test_cpu_trace_lists_host_times(tmp_path):
    path = tmp_path / "cpu.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autograd.profiler.record_function("moevlm.experts"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    prof.export_chrome_trace(str(path))
    text = trace_top.summarize(trace_top.load(path))
    assert text.startswith("no device work in this trace")
    assert "| experts |" in text
