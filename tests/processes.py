"""Finding a test's processes wherever they were reparented: by a NAME=value the test put in their
environment, which every child inherits (Linux: /proc/<pid>/environ)."""

import os
from pathlib import Path


def processes_with_env(item: str) -> set[int]:
    """The pids of the processes whose environment holds `item` (NAME=value)."""
    out = set()
    for entry in os.listdir("/proc"):
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if item.encode() in env:
            out.add(int(entry))
    return out
