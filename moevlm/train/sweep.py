"""A Hydra sweep (`train.py -m`) that outlives its failed jobs: each job's outcome is recorded, the
next job runs, and the sweep ends with one summary line and a non-zero code if any job failed.

    python train.py -m train.micro_batch_size=3,1,2 train.steps=3   # job 0 fails: 1 and 2 still run
    cat <sweep dir>/status/0.json    # {"status": "failed", "exit_code": 2, "reason": ...}
    python bench/sweep_table.py <sweep dir>                         # one row per job, with its status

`SweepStatus` (a Hydra callback, conf/config.yaml) claims the sweep root like a run directory
(moevlm.train.run_dir: the default folder takes a `-1` suffix on collision; a locked one is refused,
exit 2), clears its status folder before the first job and prints the summary after the last;
`run_job` wraps each job and writes `<sweep root>/status/<job>.json`.  An interrupted job (exit 4,
128+signum) ends the sweep.  Why: docs/architecture.md.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf, open_dict

from moevlm.train.exit_codes import ExitCode, bug_line
from moevlm.train.run_dir import RunDir, RunDirError
from moevlm.train.torchrun_exit import config_error_exit

STATUS_DIR = "status"
# this process's jobs and their codes: the exit code of a rank that does not write the records (torchrun -m)
_CODES: dict[int, int] = {}
_ROOT: list[Path] = []  # the sweep root this process's SweepStatus claimed (rank 0), for train.py
REASON_CHARS = 400  # a reason is one line: a longer one is cut (the job's own output has it whole)


def sweep_root(run_dir: str, sweep_dir: str) -> Path:
    """The folder holding the jobs' run directories: train.run_dir when set, else hydra.sweep.dir."""
    return Path(run_dir or sweep_dir).absolute()


def claimed_root() -> Path | None:
    """The sweep root rank 0's SweepStatus claimed for this sweep (None on the other ranks)."""
    return _ROOT[-1] if _ROOT else None


def status_path(root: Path, job: int) -> Path:
    return Path(root) / STATUS_DIR / f"{job}.json"


def read_statuses(root: Path) -> dict[int, dict]:
    """Job number -> its record, for every readable status file under `root`."""
    out = {}
    for path in sorted((Path(root) / STATUS_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a file cut by a kill: as if absent
        if path.stem.isdigit() and isinstance(record, dict):
            out[int(path.stem)] = record
    return out


def stops_the_sweep(code: int) -> bool:
    """A stop signal's codes: the job was interrupted, so the user wants the sweep to stop."""
    return code == ExitCode.INTERRUPTED or code >= 128


def run_job(
    fn: Callable[[], int], root: Path, job: int, run_dir: Path, overrides: list[str]
) -> int:
    """Run one sweep job (`fn` returns its exit code, or exits, or raises), record its outcome under
    `root`, and return the code, so that Hydra runs the next job.  An interrupted job ends the sweep
    (SystemExit with its code)."""
    lead = os.environ.get("RANK", "0") == "0"
    record = {
        "job": job,
        "status": "running",
        "exit_code": None,
        "reason": None,
        "run_dir": str(run_dir),
        "overrides": list(overrides),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if lead:
        _write(status_path(root, job), record)
    tee = _LastLine()
    try:
        with tee:
            code, reason = int(fn() or 0), None
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        reason = stop.code if isinstance(stop.code, str) else None
    except KeyboardInterrupt:
        code, reason = 128 + 2, "interrupted (Ctrl-C) during set-up"
    except Exception as err:  # noqa: BLE001  (a crash: shown as without a sweep, then recorded)
        traceback.print_exc()
        print(bug_line(err), file=sys.stderr, flush=True)
        code = ExitCode.BUG
        reason = traceback.format_exception_only(type(err), err)[-1].strip()
    if code and reason is None:
        reason = tee.last or f"exit code {code}"
    status = "ok" if code == 0 else "interrupted" if stops_the_sweep(code) else "failed"
    _CODES[job] = code
    record.update(
        status=status,
        exit_code=code,
        reason=_one_line(reason) if code else None,
        ended=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    if lead:
        _write(status_path(root, job), record)
    if status == "interrupted":
        if lead:
            print(
                f"sweep stopped: job {job} was interrupted (exit {code}); the jobs after it were not run",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(code)
    if code and lead:
        print(
            f"sweep job {job} failed (exit {code}: {record['reason']}); going on with the next job",
            file=sys.stderr,
            flush=True,
        )
    return code


def sweep_probes(overrides: list[str]) -> list[list[str]]:
    """Override lists that use every value of a command-line sweep once (each key's values in turn, the
    other keys at their first): composing these finds a value Hydra would refuse for the whole sweep,
    in as many compositions as there are values, not jobs.  An override the basic sweeper cannot expand
    is left to Hydra (no probes)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
        values = [
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [o.input_line]
            for o in parsed
        ]
    except Exception:  # noqa: BLE001  (syntax Hydra itself will report, or a sweep it cannot expand)
        return []
    base = [v[0] for v in values]
    probes = [base]
    for i, options in enumerate(values):
        probes += [base[:i] + [v] + base[i + 1 :] for v in options[1:]]
    return probes


def summary(root: Path) -> tuple[str, int]:
    """(the sweep's one-line summary, its exit code: the first failed job's, else 0)."""
    records = read_statuses(root)
    counts: dict[str, int] = {}
    for r in records.values():
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    failed = [(j, r) for j, r in sorted(records.items()) if r.get("status") != "ok"]
    head = f"sweep: {len(records)} job{'s' * (len(records) != 1)}"
    where = f"table: python bench/sweep_table.py {root}"
    if not failed:
        return f"{head}, all ok ({where})", 0
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    # jobs that failed alike are named together: a sweep of 12 jobs that all miss a GPU is one line
    alike: dict[tuple, list[int]] = {}
    for j, r in failed:
        alike.setdefault((r.get("status"), r.get("exit_code"), r.get("reason")), []).append(j)
    named = "; ".join(
        f"job{'s' * (len(js) > 1)} {', '.join(map(str, js))} ({state}"
        + (f", exit {code}: {reason}" if code is not None else "")
        + ")"
        for (state, code, reason), js in alike.items()
    )
    codes = [r["exit_code"] for _, r in failed if r.get("exit_code")]
    return f"{head}, {parts}: {named} ({where})", codes[0] if codes else 1


class SweepStatus(Callback):
    """Hydra callback (conf/config.yaml): the sweep root claimed and a fresh status folder before a
    sweep, its summary after."""

    def __init__(self) -> None:
        self.claim: RunDir | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        _CODES.clear()
        _ROOT.clear()
        if os.environ.get("RANK", "0") != "0":
            return
        self.claim = claim_root(config)
        _ROOT.append(self.claim.path)
        folder = self.claim.path / STATUS_DIR
        for old in folder.glob("*.json") if folder.is_dir() else ():
            old.unlink(missing_ok=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        mine = next((c for _, c in sorted(_CODES.items()) if c), 0)
        if os.environ.get("RANK", "0") == "0":
            line, code = summary(self.claim.path if self.claim else _root(config))
            if mine and not code:  # never "all ok" after a job of this sweep failed
                line, code = f"{line}; but a job of this sweep failed (exit {mine})", mine
            print(line, file=sys.stderr if code else sys.stdout, flush=True)
        else:  # rank 0 may still be writing the last record: this rank's own codes
            code = mine
        if self.claim is not None:
            self.claim.release()
        if code:
            raise SystemExit(code)


def claim_root(config) -> RunDir:
    """Rank 0's claim of the sweep root (moevlm.train.run_dir): train.run_dir, or a hydra.sweep.dir the
    user set, as named, refused while another launch holds it (a relaunch after it ended resumes its
    jobs); else Hydra's timestamped hydra.sweep.dir, or `<it>-1`, `-2` when another sweep started in
    the same second (Hydra then writes its multirun.yaml there too).  A refusal is one `config
    error:` line, exit 2."""
    run_dir = (config.get("train") or {}).get("run_dir") or ""
    # Hydra's default names the folder by the clock; a folder the user named is meant as named
    stamped = "${now:" in str(OmegaConf.to_container(config.hydra.sweep, resolve=False)["dir"])
    try:
        if run_dir:
            return RunDir.claim(run_dir, what="train.run_dir")
        claim = RunDir.claim(config.hydra.sweep.dir, default=stamped, what="hydra.sweep.dir")
    except RunDirError as err:
        config_error_exit([str(err)])
    with open_dict(config):
        config.hydra.sweep.dir = str(claim.path)
    return claim


def _root(config) -> Path:
    train = config.get("train") or {}
    return sweep_root(train.get("run_dir") or "", config.hydra.sweep.dir)


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


class _Tee:
    """A stream that writes through to `stream` and hands every completed line to `seen`."""

    def __init__(self, stream, seen: Callable[[str], None]):
        self._stream, self._seen, self._part = stream, seen, ""

    def write(self, text: str) -> int:
        *lines, self._part = (self._part + text).split("\n")
        for line in lines:
            self._seen(line)
        return self._stream.write(text)

    def __getattr__(self, name):  # flush, fileno, isatty, encoding, ...: the real stream's
        return getattr(self._stream, name)


class _LastLine:
    """While entered, sys.stdout and sys.stderr are teed; `last` is the last non-blank line either got
    (a progress bar's redrawn line, which holds a carriage return, is not one)."""

    def __init__(self):
        self.last: str | None = None
        self._saved = sys.stdout, sys.stderr

    def _seen(self, line: str) -> None:
        if line.strip() and "\r" not in line:
            self.last = line.strip()

    def __enter__(self):
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._seen), _Tee(sys.stderr, self._seen)
        return self

    def __exit__(self, *exc) -> None:
        sys.stdout, sys.stderr = self._saved
