"""bench/lora_step.py at a toy size, in this process (a check that the script works; no timing is
asserted): the LoRA side trains a fraction of the parameters and keeps a fraction of the optimizer
state, and its first loss equals full fine-tuning's (B starts at zero; the script asserts it)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_lora_bench_prints_both_sides(capsys):
    spec = importlib.util.spec_from_file_location("lora_step", REPO / "bench" / "lora_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--iters", "1", "--seq", "64", "--rank", "8", "--threads", "1"])
    out = capsys.readouterr().out
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
        for line in out.splitlines()
        if line.startswith("| ") and not line.startswith("| figure")
    }
    assert sorted(rows) == ["optimizer MiB", "peak MiB", "step ms", "trainable parameters"]
    full, lora, ratio = rows["trainable parameters"]
    assert 0 < int(lora.replace(",", "")) < int(full.replace(",", "")) and float(ratio) < 0.5
    assert 0 < float(rows["optimizer MiB"][2]) < 0.5
    assert "LoRA r=8" in out
