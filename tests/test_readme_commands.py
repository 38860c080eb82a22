"""The shell commands of the README and of the user guide's pages (user_docs.PAGES) run as written.

Every command line of their ```bash blocks is in exactly one of these tables, and a new one in none of
them fails `test_every_readme_command_is_run_or_listed`:

- RUN: run here, exactly as written (`bash -c`, `python` and `torchrun` being this interpreter and
  its torch.distributed.run), in a fresh folder holding links to train.py and conf/ as the repository
  root does; each must exit with its code, print what it promises, and leave only what .gitignore
  covers.
- ELSEWHERE: run as written by another test (named).
- SLOW: runs on a CPU, run by the same test only with MOEVLM_README_SLOW=1 (the suite's budget: each
  costs 25 s to minutes on 2 cores); the suite's own launches of the same layouts, or in-process
  tests of the same code, are named beside each.

RUN costs about 125 CPU-seconds (measured, every process of each: the 4-rank ep 4 line ~64 with its
data workers, the 4-rank pp 4 line ~46, the 20-step resume line ~16).
- SKIP: cannot run on a CPU machine, or would take hours on one (the reason).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import user_docs

REPO = Path(__file__).resolve().parents[1]

RUN = {
    "torchrun --nproc-per-node 4 train.py parallel.ep=4 parallel.dp_mode=ddp train.global_batch_size=4": (
        0,
        "world 4 = pp 1 x dp 4 x cp 1 x tp 1 = pp 1 x edp 1 x ep 4 x etp 1",
    ),
    "torchrun --nproc-per-node 4 train.py parallel.pp=4 parallel.pp_schedule=interleaved_1f1b "
    "parallel.vpp=2 model.num_layers=8": (0, "pipeline: interleaved_1f1b, pp 4 x vpp 2 = 8 stages"),
    "python train.py train.run_dir=runs/a": (0, "ok: mean loss of the first 3 steps"),
}
ELSEWHERE = {
    "python -m moevlm.data.build_shards --sample sample_shards": "test_readme.py::test_readme_own_data_commands_run",
    "python -m moevlm.data.build_shards --images photos --annotations captions.jsonl --out my_shards "
    "--tokenizer sample_shards/tokenizer.json": "test_readme.py::test_readme_own_data_commands_run",
    "python train.py data.shards=my_shards": "test_readme.py::test_readme_own_data_commands_run",
    "python -m moevlm.data.build_shards --images frames --videos clips --annotations llava_video.json "
    "--out my_shards --tokenizer HF_DIR": "data/test_video_records.py::test_builder_videos_folder_apart_from_images",
    "python train.py": "CI runs the Quick start's `python train.py` (the embedded default)",
    'pip install torch==2.13.0 -e ".[dev]" && python train.py': "CI's set-up and embedded default",
    "python -m pytest": "the suite itself",
}
SLOW = {
    "python train.py -m optim.lr=1e-3,3e-4": (
        0,
        "ok: mean loss of the first 3 steps",
        "two embedded-default jobs (~100 CPU-s); tests/train/test_trainer.py launches the same sweep "
        "with 1-step jobs",
    ),
    "torchrun --nproc-per-node 8 train.py parallel.tp=2 parallel.ep=2 parallel.etp=2 "
    "train.global_batch_size=4": (
        0,
        "world 8 = pp 1 x dp 4 x cp 1 x tp 2 = pp 1 x edp 2 x ep 2 x etp 2",
        "8 ranks; tests/parallel/test_layouts.py launches this layout under torchrun",
    ),
    "torchrun --nproc-per-node 4 train.py parallel.cp=2 parallel.tp=2": (
        0,
        "world 4 = pp 1 x dp 1 x cp 2 x tp 2",
        "tests/parallel/test_context_parallel.py launches this layout under torchrun",
    ),
    "torchrun --standalone --nproc-per-node 8 train.py +experiment=gb200_3d +scale=cpu": (
        0,
        "world 8 = pp 2 x dp 2 x cp 1 x tp 2",
        "8 ranks; tests/parallel/test_pipeline.py launches it under torchrun (with a short run)",
    ),
    "python train.py model.lora_rank=8": (
        0,
        "trainable (LoRA rank 8)",
        "the embedded default's 20 steps (~15 CPU-s); tests/train/test_lora_train.py trains it 4 steps "
        "in process",
    ),
    "python -m moevlm.plan +experiment=gb200_3d": (
        0,
        "verdict",
        "~100 s (the 30B model on fake tensors); tests/plan/test_recipes.py plans every recipe",
    ),
    "python -m moevlm.plan +experiment=h100_fsdp --gpu h200 model.recompute=full --json": (
        None,
        '"gpu": "h200"',
        "~70 s; tests/plan/test_cli.py runs the command line in-process",
    ),
    "python train.py +experiment=h100_1gpu data.shards=sample parallel.fake_world=1": (
        None,
        "verdict",
        "~15 s; tests/plan covers parallel.fake_world",
    ),
    "python train.py train.export_hf=outputs/hf": (
        0,
        "exported Hugging Face checkpoint to outputs/hf",
        "the embedded default's 20 steps, then the export (~50 CPU-s); tests/train/test_trainer.py "
        "exports a run in-process and loads the folder with transformers",
    ),
    "python -m moevlm.plan +experiment=h100_fsdp --world 64 --search --only pp=1": (
        None,
        "fit",
        "~8 minutes (the layout search over 64 GPUs); tests/plan/test_search.py",
    ),
    "python train.py model.fp8=mxfp8 model.fp8_backend=emulate": (
        None,
        "done: 20 steps",
        "FP8 emulated on the CPU: slow by design; tests/model cover the recipe's numerics",
    ),
}
SKIP = {
    "python train.py model.lora_rank=16 model.lora_modules=[attn,mlp,experts] "
    "model.hf_checkpoint=HF_DIR train.export_adapter=outputs/adapter train.export_hf=outputs/merged": (
        "the user's Hugging Face checkpoint (HF_DIR); tests/train/test_lora_train.py trains the same "
        "scopes from random weights and writes both exports"
    ),
    "python train.py +experiment=h200_1gpu data.shards=DIR": "a GPU and the user's shards (DIR)",
    "torchrun --nproc-per-node 8 train.py +experiment=h100_fsdp data.shards=DIR "
    "model.hf_checkpoint=HF_DIR": "8 GPUs, the user's shards and a Hugging Face checkpoint",
    "torchrun --nproc-per-node 32 train.py +experiment=gb200_3d data.shards=DIR": "32 GPUs (4 nodes)",
    "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-id my-run-1 "
    "--rdzv-endpoint node001:29500 train.py +experiment=gb200_3d data.shards=DIR "
    "train.run_dir=/shared/runs/a": "4 nodes of 8 GPUs",
    "python train.py model.fp8=blockwise": "a Hopper GPU (FP8 blockwise kernels; refused on the CPU)",
    "python train.py model.fp8=mxfp8": "a Blackwell GPU (MXFP8; refused on the CPU)",
    "python train.py data.shards=\"'laion/{00000..00099}.tar'\" data.tokenizer=HF_DIR/tokenizer.json": (
        "the user's img2dataset shards and tokenizer; tests/data/test_third_party.py trains on each "
        "third-party layout"
    ),
    "python -m moevlm.data.build_shards --parquet data/train-*.parquet --out my_shards "
    "--tokenizer HF_DIR": "the user's Parquet files; tests/data/test_third_party.py builds from Parquet",
    "python -m moevlm.data.build_shards --energon energon_ds --split train --out my_shards "
    "--tokenizer HF_DIR": "the user's Energon folder; tests/data/test_third_party.py builds from one",
    "python -m moevlm.plan +experiment=h100_fsdp --world 64 --search": (
        "hours on a CPU (the pipeline layouts' dry runs, docs/plans.md); tests/plan/test_search.py and "
        "test_cli.py run the search on small worlds"
    ),
    "python -m moevlm.plan +experiment=h100_fsdp --world 16 --search --only pp=1,2 --only "
    "dp_mode=fsdp,ddp --top 5": "hours on a CPU (pp=2's dry runs); tests/plan/test_cli.py runs --only and --top",
    "python -m moevlm.plan +experiment=h100_fsdp --world 16 --search --json": (
        "hours on a CPU (the pipeline layouts' dry runs); tests/plan/test_cli.py runs --search --json"
    ),
}


def readme_commands(page: str = "README.md") -> list[str]:
    """Each command line of `page`'s ```bash blocks: continuation lines joined, comment lines and
    trailing comments dropped, whitespace collapsed."""
    out = []
    for block in user_docs.blocks("bash", page):
        for line in block.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"(^|\s)#.*$", "", line).strip()
            if cmd:
                out.append(" ".join(cmd.split()))
    return out


def test_every_readme_command_is_run_or_listed():
    """A page may repeat another page's command (the README's main commands are the guide's), never its
    own."""
    by_page = {page: readme_commands(page) for page in user_docs.PAGES}
    cmds = [c for page_cmds in by_page.values() for c in page_cmds]
    tables = [RUN, ELSEWHERE, SLOW, SKIP]
    unlisted = [c for c in cmds if not any(c in t for t in tables)]
    assert not unlisted, f"README commands neither run nor listed (add them to a table): {unlisted}"
    stale = [c for t in tables for c in t if c not in cmds]
    assert not stale, f"listed commands the README no longer has: {stale}"
    for page_cmds in by_page.values():
        assert len(page_cmds) == len(set(page_cmds))


def _slow_cases():
    if os.environ.get("MOEVLM_README_SLOW") == "1":
        return [pytest.param(c, code, text, id=c) for c, (code, text, _) in SLOW.items()]
    return []


@pytest.fixture
def root(tmp_path):
    """A folder that looks like the repository root to the commands (train.py and conf/ linked), with
    `python` and `torchrun` on PATH meaning this interpreter."""
    work, shims = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    shims.mkdir()
    for name in ("train.py", "conf"):
        (work / name).symlink_to(REPO / name)
    # scripts, not links: a virtual environment's interpreter finds its packages from its own path
    for name, args in (("python", ""), ("torchrun", " -m torch.distributed.run")):
        (shims / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        (shims / name).chmod(0o755)
    return work, shims


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cmd", "code", "text"),
    [pytest.param(c, code, text, id=c) for c, (code, text) in RUN.items()] + _slow_cases(),
)
def test_readme_command_runs_as_written(cmd, code, text, root):
    work, shims = root
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        # one torch thread, as torchrun gives each of its ranks: the tiny model gains nothing from a
        # second, which fights the data workers for 2 cores (tests/train/conftest.py)
        "OMP_NUM_THREADS": "1",
    }
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        ["bash", "-c", cmd],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        check=False,
    )
    if code is not None:
        assert proc.returncode == code, proc.stdout[-4000:]
    assert text in proc.stdout, proc.stdout[-4000:]
    made = [p for p in work.iterdir() if p.name not in ("train.py", "conf")]
    assert not_ignored(made) == [], "outputs .gitignore does not cover"


def not_ignored(paths: list[Path]) -> list[str]:
    """The names among `paths` (top-level entries a command made) that the repository's .gitignore
    does not cover."""
    names = [p.name + ("/" if p.is_dir() else "") for p in paths]
    return [
        n
        for n in names
        if subprocess.run(
            ["git", "check-ignore", "--no-index", "-q", n], cwd=REPO, check=False
        ).returncode
    ]
