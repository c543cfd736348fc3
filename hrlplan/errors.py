"""Errors a user can act on: printed as one line, without a traceback, by the CLI and pretrain.py."""
from __future__ import annotations

from typing import Any, Iterable, Optional


class UserError(Exception):
    """Bad input (config, plan, model id, allocation): the message names what and says what to do."""


class ConfigError(UserError, ValueError):
    """A config value that is refused before any work starts: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any = None, allowed: Optional[Iterable[Any] | str] = None,
                 message: Optional[str] = None):
        self.key, self.value = key, value
        if message is None:
            shown = "null" if value is None else value
            message = f"{key}={shown} is not allowed"
            if allowed is not None:
                if not isinstance(allowed, str):
                    allowed = "one of " + ", ".join(str(a) for a in allowed)
                message += f": {key} must be {allowed}"
        super().__init__(" ".join(str(message).split()))  # one line, whatever the parts held


def one_line(text: Any, limit: int = 400) -> str:
    """A message squeezed onto one line (a worker's or a library's multi-line error)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
