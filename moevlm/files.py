"""File-system steps every layer takes the same way.

fsync_path(path)     # a file's bytes, or a folder's entries (a rename in it), on disk
"""

from __future__ import annotations

import os


def fsync_path(path) -> None:
    """`os.fsync` through a read-only descriptor of `path` (a file or a folder)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["fsync_path"]
