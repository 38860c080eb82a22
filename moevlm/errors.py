"""The error a wrong setting raises, and the one helper that raises it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def check(ok: bool, message: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error(message)` unless `ok`."""
    if not ok:
        raise error(message)


class Problems:
    """Every problem of a set of checks, reported at once: `run(fn, ...)` returns fn's result, or None
    with the lines of its ConfigError kept (each once); `raise_any()` raises them as one ConfigError."""

    def __init__(self):
        self.lines: list[str] = []

    def run(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:
            self.lines.extend(line for line in str(err).splitlines() if line not in self.lines)
            return None

    def raise_any(self) -> None:
        if self.lines:
            raise ConfigError("\n".join(self.lines))
