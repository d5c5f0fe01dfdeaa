"""Progress on the waits a user sits through (loading weights, the memory profile, writing a
checkpoint, the benchmark's phases), and the logging setup the command line and `LLM` share.

On a terminal a wait is a tqdm bar on stderr. Elsewhere (a log file, a service manager, a pipe)
a bar's carriage returns would be noise: the same tqdm counts, rate and estimate of what is left
go out as plain log lines instead, one when the wait starts, then every LOG_INTERVAL_S, and one
when it ends. The bar is redrawn every LOG_INTERVAL_S even when nothing was counted (one long
step, a compiler run), so no wait goes longer than that without a line or a moving bar.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterable, Sized
from typing import Any, NoReturn, TypeVar

from tqdm import tqdm

T = TypeVar("T")

LOG_INTERVAL_S = 2.5
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


class _TickingBar(tqdm):  # type: ignore[type-arg]
    """A tqdm that a daemon thread redraws every LOG_INTERVAL_S until it is closed (its elapsed time
    moves; off a terminal, a log line), however long the step between two updates takes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closed = threading.Event()
        if not self.disable:
            threading.Thread(target=self._tick, name="progress-tick", daemon=True).start()

    def _tick(self) -> None:
        while not self._closed.wait(LOG_INTERVAL_S):
            self.refresh()

    def close(self) -> None:
        self._closed.set()
        super().close()


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
        return _TickingBar(iterable, file=sys.stderr, dynamic_ncols=True, **common)
    units = unit if unit_scale else " " + unit + "s"
    if total is None:
        line = "{desc}: {n_fmt}" + units + ", {elapsed} elapsed"
    else:
        line = "{desc}: {n_fmt}/{total_fmt}" + units + " ({percentage:.0f}%), {elapsed} elapsed, ~{remaining} left"
    return _TickingBar(
        iterable,
        file=_LogLines(logger or logging.getLogger("vlmserve")),
        mininterval=LOG_INTERVAL_S,
        bar_format=line,
        **common,
    )


def waiting(desc: str, logger: logging.Logger | None = None) -> tqdm[Any]:
    """One long step with nothing to count (a compiler run, the kernel copying pages): its
    description and the time elapsed, redrawn as a progress bar is; use as a context manager."""
    if on_terminal():
        return _TickingBar(file=sys.stderr, desc=desc, bar_format="{desc}: {elapsed}", leave=True)
    return _TickingBar(
        file=_LogLines(logger or logging.getLogger("vlmserve")),
        desc=desc,
        mininterval=LOG_INTERVAL_S,
        bar_format="{desc}: {elapsed} elapsed",
        leave=True,
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


def exit_now(code: int) -> NoReturn:
    """End a process whose work is done and whose resources are released (sockets closed, child
    processes stopped, shared memory unlinked): logs and streams flushed, then out without the
    interpreter's teardown of its modules (torch's among them), which takes most of a second and
    which a server's stop would wait for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing reaches it
            stream.flush()
    os._exit(code)
