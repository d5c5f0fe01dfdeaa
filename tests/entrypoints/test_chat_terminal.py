"""`vlmserve chat` in a real terminal (a pseudo-terminal: readline, echo and all, as a user's
shell gives it): keys typed while an answer streams do not mix into the answer; they wait at the
next prompt."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROMPT = b">>> "


class Terminal:
    """A process on the slave side of a pseudo-terminal; everything it (and the terminal's echo)
    writes is collected from the master side."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "TERM": "dumb", "COLUMNS": "200"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.seen = b""

    def read_until(self, want: bytes, start: int = 0, timeout: float = 120) -> int:
        """Read until `want` appears at or after `start`; where it starts."""
        deadline = time.monotonic() + timeout
        while (at := self.seen.find(want, start)) < 0:
            self._read(deadline, f"no {want!r}")
        return at

    def read_past(self, length: int, timeout: float = 120) -> None:
        """Read until the terminal has shown more than `length` bytes."""
        deadline = time.monotonic() + timeout
        while len(self.seen) <= length:
            self._read(deadline, f"not {length} bytes")

    def _read(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        assert left > 0, f"{what} in time; the terminal shows:\n{self.seen.decode(errors='replace')}"
        if select.select([self.master], [], [], min(left, 1.0))[0]:
            with contextlib.suppress(OSError):  # OSError: the process closed the terminal
                self.seen += os.read(self.master, 65536)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            os.close(self.master)


def test_keys_typed_while_an_answer_streams_wait_for_the_next_prompt(tiny_dir: Path) -> None:
    exe = shutil.which("vlmserve", path=str(Path(sys.executable).parent)) or shutil.which("vlmserve")
    assert exe, "the vlmserve console script is not installed (pip install -e .)"
    # Greedy on the tiny random checkpoint: a long answer with no eos in it (deterministic), so
    # the typing lands while it is streaming.
    term = Terminal([exe, "chat", str(tiny_dir), "--dtype", "float32", "--temperature", "0", "--max-tokens", "300"])
    try:
        first_prompt = term.read_until(PROMPT)
        term.type(b"Tell me a story.\r")
        answer_starts = term.read_until(b"Tell me a story.\r\n", first_prompt) + len(b"Tell me a story.\r\n")
        term.read_past(answer_starts + 5)  # the answer's first characters; then keys, mid-stream
        typed_at = len(term.seen)
        term.type(b"typed ahead")
        second_prompt = term.read_until(PROMPT, answer_starts)
        answer = term.seen[answer_starts:second_prompt]
        # The answer went on streaming after the keys were typed, and they are not in it.
        assert term.seen[typed_at:second_prompt].strip(), "the answer had finished before the typing"
        assert b"typed" not in answer, answer
        # They wait at the next prompt (readline shows them there), as typed.
        term.read_until(PROMPT + b"typed ahead", second_prompt)
        term.type(b"\x15\x04")  # Ctrl-U clears the line, Ctrl-D quits
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
