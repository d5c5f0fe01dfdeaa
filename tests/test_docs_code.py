"""Every code block in README.md and docs/*.md is run or checked, so that what a reader copies works.

- ```python blocks run as written, in a fresh interpreter, but for the substitutions each handler
  below lists (a hub id becomes the embedded demo checkpoint or a tiny one of the same family,
  example file names become files written for the run, the server's address and key become a
  running server's), each of which must occur in the block. What they print is checked where the
  model makes it checkable (the demo checkpoint names the example's shapes).
- ```bash blocks: each command is parsed by the parser that would run it (`vlmserve COMMAND`, and
  `python -m vlmserve...` modules, up to their argument parsing: benchmarks take minutes to hours);
  a synopsis line (`[--option VALUE]`) names only options its command has, with their choices;
  README's `pytest -m` selections each select tests; the commands that install packages, download
  from the hub or run other projects' environments are listed in NOT_RUN with the reason.
- ```text and unlabelled blocks are output and listings: not code.

README's two setup commands are run by CI itself (.ci/run; tests/test_readme.py keeps them equal),
and its `vlmserve chat` question by tests/tools/test_demo_model.py.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.api.conftest import Server
from tests.conftest import write_video
from vlmserve.tools import scenes
from vlmserve.tools.demo_checkpoint import demo_checkpoint_dir
from vlmserve.tools.eval_demo import names_shapes

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(Block(str(path.relative_to(REPO)), line, m.group(1), m.group(2)))
    return found


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b.lang == "python"]
BASH = [b for b in BLOCKS if b.lang == "bash"]


# -- python blocks ---------------------------------------------------------------------------------


@dataclass
class Run:
    """What a python block needs: the files it names, its substitutions, a check of its output."""

    cwd: Path
    substitutions: dict[str, str]
    check: Callable[[str], None]


def _png(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "examples" / "shapes.png", path)


def _names_the_shapes(stdout: str) -> None:
    assert names_shapes(scenes.example_scene(), stdout), stdout


def _intro(tmp: Path, server: Callable[..., Server]) -> Run:
    # README's first example: the demo checkpoint (a Qwen2-VL) for Qwen2-VL-2B-Instruct, greedy.
    _png(tmp / "examples" / "shapes.png")
    return Run(tmp, {'"Qwen/Qwen2-VL-2B-Instruct"': repr(str(demo_checkpoint_dir()))}, _names_the_shapes)


def _openai(tmp: Path, server: Callable[..., Server]) -> Run:
    s = server()
    _png(tmp / "examples" / "shapes.png")
    subs = {"http://127.0.0.1:8000": s.url, 'api_key="KEY"': f'api_key="{s.api_key}"'}
    return Run(tmp, subs, _names_the_shapes)


def _options(tmp: Path, server: Callable[..., Server]) -> Run:
    # The Python API's tour: every option, generate with an image and with a video, chat with an
    # image URL, a local file and a video; media written here, the URL a data: URL of a picture.
    _png(tmp / "cat.jpg")
    _png(tmp / "data" / "b.png")
    (tmp / "clip.mp4").write_bytes(write_video(16, fps=4))
    (tmp / "data" / "c.mp4").write_bytes(write_video(16, fps=4))
    url = "data:image/png;base64," + base64.b64encode((REPO / "examples" / "shapes.png").read_bytes()).decode()
    subs = {
        '"path/to/Qwen2-VL-2B-Instruct"': repr(str(demo_checkpoint_dir())),
        "https://example.com/a.jpg": url,
        "file:///data/": f"file://{tmp}/data/",
    }

    def check(stdout: str) -> None:
        lines = stdout.splitlines()  # one per conversation: 8 prompt ids, the text, why it stopped
        assert len(lines) == 3 and all(line.endswith(("stop", "length")) for line in lines), stdout
        assert all(line.startswith("[151644, 8948, 198") for line in lines), stdout  # <|im_start|>system\n

    return Run(tmp, subs, check)


def _grounding(tmp: Path, server: Callable[..., Server]) -> Run:
    # Qwen2.5-VL's example run on the demo checkpoint (a Qwen2-VL, so Qwen2-VL's convention), asked
    # the grounding question it was trained on: boxes to map, print and draw.
    _png(tmp / "photo.jpg")
    subs = {
        '"Qwen/Qwen2.5-VL-3B-Instruct"': repr(str(demo_checkpoint_dir())),
        'convention_for_model("qwen2_5_vl")': 'convention_for_model("qwen2_vl")',
        "Locate every cat in the picture and output its bbox_2d in JSON.": "Find every shape.",
    }

    def check(stdout: str) -> None:
        boxes = re.findall(r"^the (\w+ \w+) \([\d.]+, [\d.]+, [\d.]+, [\d.]+\)", stdout, re.M)
        assert boxes and set(boxes) <= {"green square", "yellow triangle"}, stdout
        assert (tmp / "boxes.png").is_file()

    return Run(tmp, subs, check)


def _lora(tmp: Path, server: Callable[..., Server]) -> Run:
    # The LoRA example on the demo checkpoint, with a random adapter written for it by the LoRA
    # benchmark's writer (PEFT's files and names).
    from vlmserve.bench.lora import write_lora_adapter

    demo = demo_checkpoint_dir()
    adapter = write_lora_adapter(demo, tmp / "adapter", rank=8, seed=0)
    subs = {'"path/to/Qwen2.5-VL-3B-Instruct"': repr(str(demo)), '"path/to/captions-adapter"': repr(str(adapter))}

    def check(stdout: str) -> None:
        assert stdout.strip(), "the LoRA example printed nothing"

    return Run(tmp, subs, check)


def _pooling(tmp: Path, server: Callable[..., Server]) -> Run:
    # The pooling example on tiny checkpoints in the two published layouts (make-tiny's presets).
    from vlmserve.registry import BY_NAME

    _png(tmp / "examples" / "shapes.png")
    embedding = BY_NAME["qwen3_vl"].write_tiny(tmp / "embedding", preset="embedding")
    reranker = BY_NAME["qwen3_vl"].write_tiny(tmp / "reranker", preset="reranker")
    subs = {'"Qwen/Qwen3-VL-Embedding-2B"': repr(str(embedding)), '"Qwen/Qwen3-VL-Reranker-2B"': repr(str(reranker))}

    def check(stdout: str) -> None:
        size, cosine, short, *scores = stdout.split()
        assert (size, short) == ("64", "32") and -1.0 <= float(cosine) <= 1.0, stdout
        assert len(scores) == 2 and all(0.0 < float(s) < 1.0 for s in scores) and scores[0] != scores[1], stdout

    return Run(tmp, subs, check)


def _embeddings(tmp: Path, server: Callable[..., Server]) -> Run:
    # The pooling models' example on the tiny Qwen3-VL-Embedding's server (an embedding model's
    # rerank scores are cosine similarities), served as "tiny".
    s = server("embedding_server")
    subs = {
        "http://127.0.0.1:8001": s.url,
        'api_key="KEY"': f'api_key="{s.api_key}"',
        '"Bearer KEY"': f'"Bearer {s.api_key}"',
        '"Qwen3-VL-Embedding-2B"': '"tiny"',
    }

    def check(stdout: str) -> None:
        lines = stdout.splitlines()
        assert lines[0].startswith("2 64 ") and len(lines) == 3, stdout  # two embeddings of the tiny model's size
        assert sorted(lines[1].split()) == ["0", "1"], stdout  # both documents ranked

    return Run(tmp, subs, check)


# A python block is recognised by a line it holds; each must be exactly one of these.
PYTHON_RUNS: dict[str, Callable[[Path, Callable[..., Server]], Run]] = {
    'llm = LLM("Qwen/Qwen2-VL-2B-Instruct")': _intro,
    'client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY")': _openai,
    '"path/to/Qwen2-VL-2B-Instruct",': _options,
    'llm = LLM("Qwen/Qwen2.5-VL-3B-Instruct")': _grounding,
    'adapter = LoRARequest("captions", 1, "path/to/captions-adapter")': _lora,
    'embedder = LLM("Qwen/Qwen3-VL-Embedding-2B", max_model_len=8192)': _pooling,
    'client = OpenAI(base_url="http://127.0.0.1:8001/v1", api_key="KEY")': _embeddings,
}


def _handler(block: Block) -> Callable[[Path, Callable[..., Server]], Run]:
    (key,) = [key for key in PYTHON_RUNS if key in block.body] or [None]
    assert key is not None, f"{block}: a python block no test runs; add it to PYTHON_RUNS"
    return PYTHON_RUNS[key]


@pytest.fixture
def demo_server(request: pytest.FixtureRequest) -> Callable[..., Server]:
    """The server README's openai snippet expects (`vlmserve serve`, no model: the demo checkpoint
    under its folder's name), started on first use: the session's (tests/conftest.py); another of
    the session's servers by its fixture's name."""
    return lambda name="demo_checkpoint_server": request.getfixturevalue(name)


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_block_runs(block: Block, tmp_path: Path, demo_server: Callable[..., Server]) -> None:
    run = _handler(block)(tmp_path, demo_server)
    code = block.body
    for old, new in run.substitutions.items():
        assert old in code, f"{block}: {old!r} is no longer in the block; update its handler"
        code = code.replace(old, new)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=run.cwd, capture_output=True, text=True, timeout=600, env={**os.environ}
    )
    assert result.returncode == 0, f"{block}:\n{result.stderr[-3000:]}"
    run.check(result.stdout)


def test_every_python_block_has_a_run() -> None:
    assert PYTHON, "no python blocks found: the fence pattern is wrong"
    handled = {_handler(block) for block in PYTHON}
    assert handled == set(PYTHON_RUNS.values()), "a handler whose block is gone: remove it"


def test_blocks_are_labelled() -> None:
    """A block is python, bash, or output (text, or no label): nothing else escapes the checks."""
    odd = [f"{b} ({b.lang})" for b in BLOCKS if b.lang not in ("python", "bash", "text", "")]
    assert not odd, odd


# -- bash blocks -----------------------------------------------------------------------------------

# Commands not run, by their first word (or `python -m` module), and why.
NOT_RUN = {
    "pip": "installs packages",
    "python -m pip": "installs packages",
    "python -m venv": "makes an environment",
    ".": "activates an environment",
    "export": "sets a variable for the commands after it",
    "hf": "downloads from the Hugging Face hub, which the tests cannot reach",
    "ruff": "run by CI: .ci/run runs README's test command verbatim",
    "mypy": "run by CI: .ci/run runs README's test command verbatim",
    "lint-imports": "run by CI: .ci/run runs README's test command verbatim",
    "tar": "unpacks llama.cpp's source",
    "cd": "enters llama.cpp's source tree",
    "rm": "edits vLLM's environment",
    "sed": "edits vLLM's environment",
    "echo": "edits the local git exclude file",
    "nvidia-smi": "needs a GPU",
    "tee": "keeps a copy of the output",
    "curl": "calls a running server (the example's adapters are not there)",
    "exit": "stops the script when the install before it failed",
    "venv": "runs another project's environment (vLLM's, llama.cpp's) with its own install",
    "python script": "runs llama.cpp's own converter, from its source tree",
}
REDIRECT = re.compile(r"^\d?(>>?|<)(&\d)?$|^\d?>&\d$")
ASSIGNMENT = re.compile(r"^([A-Z_]+)=(.*)$")


@dataclass(frozen=True)
class Command:
    block: Block
    words: tuple[str, ...]
    synopsis: bool  # written with [optional] parts and placeholders, not to be run as is

    def __str__(self) -> str:
        return f"{self.block}: {' '.join(self.words)}"


def _split(line: str) -> list[str]:
    """A shell line split at &&, ; and | outside quotes, up to its comment."""
    parts, current, quote, i = [], "", "", 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            break
        elif ch in "'\"":
            quote = ch
        elif line.startswith("&&", i) or ch in ";|":
            parts.append(current)
            current, i = "", i + (2 if ch == "&" else 1)
            continue
        current += ch
        i += 1
    return [*parts, current]


def _commands(block: Block) -> list[Command]:
    """The block's commands: lines joined at `\\`, split at &&, ; and |, comments and redirections
    dropped, VAR="..." assignments expanded where $VAR is used, leading VAR=value environment
    settings dropped."""
    text = block.body.replace("\\\n", " ")
    text = re.sub(r"\n(?=    \[)", " ", text)  # a synopsis continues on indented lines
    variables: dict[str, str] = {}
    commands = []
    for line in text.splitlines():
        code = shlex.split(line, comments=True)
        synopsis = any(word.startswith("[") for word in code)
        line = line.replace("[VLMSERVE_CPU_PATH=PATH] ", "")
        for name, value in variables.items():
            line = line.replace(f"${name} ", value + " ")
        for part in [line] if synopsis else _split(line):  # a synopsis's | separates choices
            words = [w for w in shlex.split(part, comments=True) if not REDIRECT.match(w)]
            while words and (m := ASSIGNMENT.match(words[0])):
                if len(words) == 1:
                    variables[m.group(1)] = m.group(2)
                words = words[1:]
            if words:
                commands.append(Command(block, tuple(words), synopsis))
    return commands


COMMANDS = [c for b in BASH for c in _commands(b)]


def _not_run(command: Command) -> str | None:
    words = command.words
    first = words[0]
    if first in ("python", "python3"):
        if words[1] == "-m":
            return NOT_RUN.get(f"python -m {words[2]}")
        return NOT_RUN["python script"] if words[1].endswith(".py") else None
    if "venv/bin/" in first:
        return NOT_RUN["venv"]
    return NOT_RUN.get(first)


def _parser_for(words: tuple[str, ...]) -> tuple[argparse.ArgumentParser, list[str]]:
    from vlmserve.entrypoints.cli import command_parser

    assert words[0] == "vlmserve", words
    return command_parser(words[1]), list(words[2:])


class _Parsed(Exception):
    pass


def _parse_module(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Run `python -m module argv` up to its argument parsing (a SystemExit 2 if they are wrong)."""
    parse_args = argparse.ArgumentParser.parse_args
    parse_intermixed = argparse.ArgumentParser.parse_intermixed_args

    def stop_after(parse: Callable[..., argparse.Namespace]) -> Callable[..., argparse.Namespace]:
        def parsed(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
            raise _Parsed(parse(self, *args, **kwargs))

        return parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop_after(parse_args))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_intermixed_args", stop_after(parse_intermixed))
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(_Parsed) as parsed:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    namespace = parsed.value.args[0]
    assert isinstance(namespace, argparse.Namespace)
    return namespace


def _check_synopsis(command: Command) -> None:
    """Each --option a synopsis names is one of its command's, and a `--option a|b|c` lists the
    option's choices."""
    parser, _ = _parser_for(command.words)
    actions = {option: action for action in parser._actions for option in action.option_strings}
    words = list(command.words)
    for i, word in enumerate(words):
        option = word.strip("[]")
        if not option.startswith("-") or option == "...":
            continue
        assert option in actions, f"{command}: {command.words[1]} has no option {option}"
        value = words[i + 1].strip("[]") if i + 1 < len(words) else ""
        choices = actions[option].choices
        if "|" in value and choices is not None:
            assert set(value.split("|")) == set(map(str, choices)), f"{command}: {option} takes {sorted(choices)}"


def _parsed_here(command: Command) -> bool:
    words = command.words
    module = words[2] if words[0] in ("python", "python3") and words[1:2] == ("-m",) else ""
    return words[0] == "vlmserve" or module.startswith("vlmserve.")


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
@pytest.mark.parametrize("command", [c for c in COMMANDS if _parsed_here(c)], ids=str)
def test_command_parses(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    words = command.words
    if words[0] == "vlmserve":
        if words[1] in ("--help", "--version"):
            from vlmserve.entrypoints.cli import main

            with pytest.raises(SystemExit) as exited:
                main([words[1]])
            assert exited.value.code == 0
        elif command.synopsis:
            _check_synopsis(command)
        else:
            parser, argv = _parser_for(words)
            parser.parse_intermixed_args(argv)  # SystemExit(2), saying why, if the docs are wrong
        return
    # A module's optional parts ([--dtype bfloat16]) are parsed as if given.
    argv = [word.strip("[]") for word in words[3:] if word != "..."]
    _parse_module(words[2], argv, monkeypatch)


def test_every_bash_command_is_checked() -> None:
    """Every command is parsed above, is one of README's pytest selections (checked below), or is
    in NOT_RUN with a reason."""
    unchecked = [str(c) for c in COMMANDS if not _parsed_here(c) and c.words[0] != "pytest" and _not_run(c) is None]
    assert not unchecked, unchecked
    assert len(COMMANDS) > 40, "the commands were not found: the parsing is wrong"


@pytest.mark.slow
def test_readmes_pytest_selections_select_tests() -> None:
    """README's `pytest -q [PATH] -m EXPR` commands each select some tests and fewer than all
    (one collection of the whole suite; tests/marker_counts.py counts each selection)."""
    selections = []
    for command in COMMANDS:
        if command.words[0] != "pytest":
            continue
        words = [w for w in command.words[1:] if w != "-q"]
        expression = words[words.index("-m") + 1] if "-m" in words else ""
        paths = [w for i, w in enumerate(words) if not w.startswith("-") and (i == 0 or words[i - 1] != "-m")]
        selections.append([paths[0] if paths else "", expression])
    assert len(selections) >= 5, selections
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.marker_counts"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLMSERVE_SELECTIONS": json.dumps(selections)},
    )
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("SELECTION-COUNTS ")]
    report = json.loads(line.removeprefix("SELECTION-COUNTS "))
    total = report["all"]
    for (path, expression), count in zip(selections, report["counts"], strict=True):
        if path or expression:
            assert 0 < count < total, f"pytest {path} -m {expression!r} selects {count} of {total}"
        else:
            assert count == total
