"""The multi-node launch: scripts/slurm/train.sbatch and docs/training.md's torchrun command.

The batch script runs under bash with TEST DOUBLES of Slurm's `srun` and
`scontrol` on PATH (small shell scripts written here): the fake srun records
its arguments and either exits at once or waits for SIGTERM like a training job
that checkpoints and exits; the fake scontrol lists the nodes and records
requeues.  The torchrun command lines (the script's and docs/training.md's) are
parsed by torch's own torchrun argument parser.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_LOG/srun.args"
if [ "$FAKE_SRUN" = wait ]; then
    trap 'echo TERM >> "$FAKE_LOG/srun.signals"; kill $SLEEP; exit 1' TERM
    sleep 60 > /dev/null 2>&1 &
    SLEEP=$!
    touch "$FAKE_LOG/srun.ready"
    wait $SLEEP
    exit 9
fi
exit 0
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1" in
    show) printf 'gpu-a17\\ngpu-a18\\n' ;;
    requeue) echo "$2" >> "$FAKE_LOG/requeued" ;;
esac
"""


def run_script(tmp_path: Path, srun_mode: str, send: signal.Signals | None, *overrides: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path),
        "FAKE_SRUN": srun_mode,
        "SLURM_JOB_ID": "4711",
        "SLURM_JOB_NAME": "vlm",
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_GPUS_ON_NODE": "4",
    }
    env.pop("RUN_DIR", None)
    # as Slurm starts a batch script: the signals at their defaults, whatever this process ignores (a
    # signal ignored when bash starts cannot be trapped)
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *overrides],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_default_signals,
    )
    if send is not None:
        # the signal comes while the script waits on srun, as Slurm's warning does (120 s before the
        # limit): on a busy machine the fake srun can be ready before the script has noted its pid
        deadline = time.monotonic() + 120  # a hang bound, wide for a busy machine
        while not ((tmp_path / "srun.ready").exists() and _waiting(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, (
                "the fake srun never started"
            )
            time.sleep(0.05)
        proc.send_signal(send)
    out, _ = proc.communicate(timeout=120)  # a hang stops here; a loaded machine takes its time
    requeued = (
        (tmp_path / "requeued").read_text().split() if (tmp_path / "requeued").exists() else []
    )
    signals = (
        (tmp_path / "srun.signals").read_text().split()
        if (tmp_path / "srun.signals").exists()
        else []
    )
    return (
        proc.returncode,
        (tmp_path / "srun.args").read_text().splitlines(),
        requeued,
        signals,
        out,
    )


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def _waiting(pid: int) -> bool:
    """Whether process `pid` sleeps in wait(2) (Linux /proc/PID/wchan; where the kernel does not say,
    taken as yes)."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return True
    return wchan in ("do_wait", "0", "")


def test_script_is_valid_bash_with_the_documented_settings():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    for line in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --ntasks-per-node=1"):
        assert line in text.splitlines()


def test_one_torchrun_per_node_with_c10d_rendezvous_and_overrides_passed_through(tmp_path):
    shards = "data.shards='/data/shard-{000000..000099}.tar'"
    code, args, requeued, _, out = run_script(
        tmp_path, "exit0", None, "+experiment=gb200_3d", shards, "optim.lr=1e-4"
    )
    assert code == 0 and requeued == []
    i = args.index("torchrun")
    assert "--ntasks-per-node=1" in args[:i]
    ns = get_args_parser().parse_args(args[i + 1 :])  # torchrun accepts every flag
    assert (ns.nnodes, ns.nproc_per_node, ns.rdzv_backend) == ("2", "4", "c10d")
    assert (ns.rdzv_id, ns.rdzv_endpoint, ns.shutdown_timeout) == ("4711", "gpu-a17:29500", 110)
    assert ns.training_script == "train.py"
    assert ns.training_script_args == [
        "train.run_dir=runs/vlm-4711",
        "+experiment=gb200_3d",
        shards,
        "optim.lr=1e-4",
    ]
    assert "rendezvous at gpu-a17:29500, run dir runs/vlm-4711" in out


@pytest.mark.parametrize("send, requeue", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_time_limit_warning_checkpoints_and_requeues(tmp_path, send, requeue):
    """USR1 (--signal=B:USR1@120) and SIGTERM both reach srun as SIGTERM (the ranks checkpoint and exit);
    only the time-limit warning requeues the job."""
    code, _, requeued, signals, out = run_script(tmp_path, "wait", send)
    assert signals == ["TERM"] and code == 1  # srun's own status, not the interrupted wait's
    assert requeued == (["4711"] if requeue else [])
    assert ("requeueing job 4711" in out) == requeue


def test_readme_multinode_torchrun_command_parses():
    text = (REPO / "docs/training.md").read_text()
    section = text[text.index("## Multi-node") : text.index("## Tuning a run")]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).replace("\\\n", " ")
    (line,) = [ln for ln in block.splitlines() if ln.startswith("torchrun")]
    ns = get_args_parser().parse_args(shlex.split(line)[1:])
    assert ns.rdzv_backend == "c10d" and ns.nnodes == "4" and ns.rdzv_endpoint == "node001:29500"
    assert ns.training_script == "train.py" and any(
        a.startswith("train.run_dir=") for a in ns.training_script_args
    )
