"""The pipeline schedules a job may name: torch's class for each, where its stages sit, how many
each rank holds.

    schedule_name("Interleaved1F1B")    # "interleaved_1f1b" (case and class-name spellings)
    SCHEDULES["zbv"]                    # ("ScheduleZBVZeroBubble", "v", "=2")
    stage_rank("zbv", pp=4, stage=6)    # 1: the pp rank that holds a stage

Placement: `loop` schedules put stage s on rank s % pp; `v` schedules put stages r and 2pp-1-r on
rank r (torch's placement for them).
"""

from __future__ import annotations

from moevlm.errors import ConfigError

# name -> (torch.distributed.pipelining class, stage placement, stages per rank: fixed or minimum)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "loop", "=1"),
    "1f1b": ("Schedule1F1B", "loop", "=1"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", ">=2"),
    "zbv": ("ScheduleZBVZeroBubble", "v", "=2"),
    "dualpipev": ("ScheduleDualPipeV", "v", "=2"),
}
# other accepted spellings: torch's class names
_ALIASES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "interleaved_1f1b",
    "zbvzerobubble": "zbv",
    "zb_v": "zbv",
    "dualpipe_v": "dualpipev",
}


def schedule_name(name: str) -> str:
    """The canonical schedule name for `name` (case and the class-name spellings are accepted)."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key.replace("_", ""), _ALIASES.get(key, key))
    if key not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={name!r}; choose one of {list(SCHEDULES)}")
    return key


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The pp rank that holds `stage` under `schedule` (module docstring)."""
    if SCHEDULES[schedule][1] == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp
