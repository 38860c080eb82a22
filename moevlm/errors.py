"""The error a wrong setting raises, and the one helper that raises it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def check(ok: bool, message: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error(message)` unless `ok`."""
    if not ok:
        raise error(message)
