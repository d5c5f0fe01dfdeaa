"""README's commands are the ones that run: CI runs README's test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    return re.findall(r"```bash\n(python3 -m venv .*?)\n```", (REPO / "README.md").read_text())


def test_ci_runs_readme_test_command() -> None:
    demo, test = _commands()
    assert "vlmserve chat --image examples/shapes.png" in demo
    assert "pytest" in test
    assert test in (REPO / ".ci" / "run").read_text().splitlines()
    assert (REPO / "examples" / "shapes.png").is_file()
