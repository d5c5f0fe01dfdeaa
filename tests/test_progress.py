"""Long waits keep saying so: a progress bar (a log line off a terminal) is redrawn every
LOG_INTERVAL_S while it is open, even when one step between two updates takes longer (a big model's
worst-case step, a compiler run), and stops when it is closed."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from vlmserve import progress as progress_module
from vlmserve.progress import progress, waiting


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.1)
    monkeypatch.setattr(progress_module, "on_terminal", lambda: False)
    caplog.set_level(logging.INFO, logger="vlmserve.test_progress")
    return caplog


def test_a_long_step_between_updates_still_logs(log: pytest.LogCaptureFixture) -> None:
    with progress(desc="profiling", total=3, unit="part", logger=logging.getLogger("vlmserve.test_progress")) as bar:
        time.sleep(2.3)  # one part that takes 23 intervals
        bar.update(3)
    lines = log.messages
    # a line each time the text changed (the same text is logged once): each second of the wait
    during = [line for line in lines if line.startswith("profiling: 0/3 parts")]
    assert [re.search(r"00:0\d", line)[0] for line in during] == ["00:00", "00:01", "00:02"], lines  # type: ignore[index]
    assert lines[-1].startswith("profiling: 3/3 parts (100%)"), lines
    time.sleep(0.3)
    assert log.messages == lines, "a closed bar went on logging"
    assert not [t for t in threading.enumerate() if t.name == "progress-tick"]


def test_waiting_logs_the_time_elapsed(log: pytest.LogCaptureFixture) -> None:
    with waiting("compiling kernel.c", logging.getLogger("vlmserve.test_progress")):
        time.sleep(1.2)
    lines = log.messages
    assert lines[0] == "compiling kernel.c: 00:00 elapsed", lines
    assert lines[-1] == "compiling kernel.c: 00:01 elapsed", lines
    assert all(re.fullmatch(r"compiling kernel\.c: 00:0[01] elapsed", line) for line in lines), lines
    assert len(lines) == 2  # the same text twice is logged once
