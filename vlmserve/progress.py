"""Progress on the waits a user sits through (loading weights, the memory profile, writing a
checkpoint, the benchmark's phases), and the logging setup the command line and `LLM` share.

On a terminal a wait is a tqdm bar on stderr. Elsewhere (a log file, a service manager, a pipe)
a bar's carriage returns would be noise: the same tqdm counts, rate and estimate of what is left
go out as plain log lines instead, one when the wait starts, then at most every LOG_INTERVAL_S,
and one when it ends.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sized
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")

LOG_INTERVAL_S = 5.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%H:%M:%S"


class _LogLines:
    """A file for tqdm that turns each of its refreshes into one log record."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.last = ""

    def write(self, text: str) -> None:
        line = text.strip("\r\n ")
        if line and line != self.last:  # tqdm's close() repeats the last refresh
            self.logger.info(line)
            self.last = line

    def flush(self) -> None:
        pass


def on_terminal() -> bool:
    return sys.stderr.isatty()


def progress(
    iterable: Iterable[T] | None = None,
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    unit_scale: bool = False,
    logger: logging.Logger | None = None,
) -> tqdm[T]:
    """A tqdm over `iterable` (or updated by hand): a bar on a terminal, log lines elsewhere.
    `unit` is singular ("tensor"); with `unit_scale` counts read 1.2M (for bytes: unit "B")."""
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    common = {"desc": desc, "total": total, "unit": unit, "unit_scale": unit_scale, "leave": True}
    if on_terminal():
        return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **common)
    units = unit if unit_scale else " " + unit + "s"
    if total is None:
        line = "{desc}: {n_fmt}" + units + ", {elapsed} elapsed"
    else:
        line = "{desc}: {n_fmt}/{total_fmt}" + units + " ({percentage:.0f}%), {elapsed} elapsed, ~{remaining} left"
    return tqdm(
        iterable,
        file=_LogLines(logger or logging.getLogger("vlmserve")),
        mininterval=LOG_INTERVAL_S,
        bar_format=line,
        **common,
    )


def configure_logging(level: str | int = "INFO") -> None:
    """vlmserve's log records at `level` to stderr (the command line's setup): a stderr handler on
    the root logger unless one is there, which leaves other libraries at WARNING."""
    logging.basicConfig(format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT, stream=sys.stderr)
    logging.getLogger("vlmserve").setLevel(level.upper() if isinstance(level, str) else level)


def configure_default_logging() -> None:
    """As vLLM does for its `LLM`: INFO records of vlmserve's loggers go to stderr unless the
    application configured logging itself (a handler on the root or vlmserve logger) or set
    VLMSERVE_CONFIGURE_LOGGING=0."""
    if os.environ.get("VLMSERVE_CONFIGURE_LOGGING", "1") == "0":
        return
    if logging.getLogger().handlers or logging.getLogger("vlmserve").handlers:
        return
    configure_logging("INFO")
