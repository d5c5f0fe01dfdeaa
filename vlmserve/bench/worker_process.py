"""Another engine in its own Python environment, as a process that loads its model once and then
answers commands: one line in on stdin, one JSON line back on stdout (lines that are not JSON,
such as its libraries' messages, are skipped). Used by the vLLM and llama.cpp comparisons."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any


class WorkerProcess:
    def __init__(self, python: str, script: str, args: list[str], env_defaults: dict[str, str] | None = None) -> None:
        """`script`: a file beside this one; `env_defaults`: variables the environment may override."""
        environment = (env_defaults or {}) | dict(os.environ)
        environment.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            # -P: the worker's own folder (vlmserve/bench, whose kernels.py would shadow the
            # `kernels` package transformers looks for) stays off sys.path
            [python, "-P", str(Path(__file__).with_name(script)), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environment,
        )
        self.ready = self._answer()  # the worker's first line: loaded, with its start-up time

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the worker exited ({self.proc.wait()}) before answering")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def emit_report(report: dict[str, Any], out: Path | None) -> None:
    """A comparison's report: printed as JSON, and written to `out` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


def round_medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Each numeric column's median over the rounds of a comparison (the round number left out)."""
    return {k: statistics.median(row[k] for row in rounds) for k in rounds[0] if k != "round"}
