"""What the ``python -m fastnmt.*`` commands share: the one UsageError, and reporting bad input as
one line on stderr with exit status 2. Standard library only (no torch), so that importing it
costs nothing."""

from __future__ import annotations

import sys

BAD_INPUT = 2  # the exit status of a bad argument, bad data or a bad checkpoint


class UsageError(ValueError):
    """A bad command-line value; the message is one line."""


def report_error(error: Exception) -> int:
    """Print ``error: MESSAGE`` on stderr; returns the exit status for bad input."""
    print(f"error: {error}", file=sys.stderr)
    return BAD_INPUT
