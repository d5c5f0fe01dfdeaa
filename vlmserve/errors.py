"""Errors a user can put right, which the command line reports in one line (no traceback)."""

from __future__ import annotations


class UserError(Exception):
    """Running the command failed for a reason outside vlmserve (a busy port, no network): exit 1."""

    exit_code = 1


class UsageError(UserError):
    """The command line itself is wrong (an option's value, a path that names nothing): exit 2."""

    exit_code = 2
