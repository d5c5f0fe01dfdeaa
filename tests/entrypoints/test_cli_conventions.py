"""The command line as a newcomer meets it, run as a user runs it (the `vlmserve` console script
in a subprocess): every command listed, --version, mistakes refused in one line with the
documented exit code and before any model loads, and a conversation that keeps its history."""

from __future__ import annotations

import ast
import os
import re
import shutil
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUNSET = REPO / "examples" / "sunset.png"
# Printed only once a model starts loading: an error reported before any of these came early.
LOADING = ("loading weights", "profiling memory", "Traceback")


def vlmserve(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("vlmserve", path=str(Path(sys.executable).parent)) or shutil.which("vlmserve")
    assert exe, "the vlmserve console script is not installed (pip install -e .)"
    return subprocess.run(
        [exe, *args], input=stdin, capture_output=True, text=True, timeout=timeout, env={**os.environ}
    )


def one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The run failed with `code` and said why in exactly one line of stderr."""
    lines = result.stderr.splitlines()
    assert result.returncode == code, result.stderr
    assert len(lines) == 1, result.stderr
    assert not any(word in result.stderr for word in LOADING), result.stderr
    return lines[0]


def test_help_lists_every_command_with_its_summary() -> None:
    result = vlmserve("--help")
    assert result.returncode == 0, result.stderr
    section = result.stdout.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    listed = dict(re.findall(r"^  (\S+) +(.+)$", section, re.MULTILINE))
    assert list(listed) == ["serve", "chat", "worker", "bench", "make-tiny", "inspect"]
    from vlmserve.entrypoints.cli import COMMANDS

    assert listed == {name: command.summary for name, command in COMMANDS.items()}


def test_version_is_the_installed_packages() -> None:
    result = vlmserve("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"vlmserve {version('vlmserve')}\n"


def test_every_option_of_every_command_has_help_and_says_its_default() -> None:
    from vlmserve.entrypoints.cli import COMMANDS, command_parser

    for name in COMMANDS:
        parser = command_parser(name)
        for action in parser._actions:
            assert action.help, f"vlmserve {name} {action.option_strings or action.dest} has no help text"
        text = parser.format_help().split("\noptions:\n", 1)[1]
        for action in parser._actions:
            if action.option_strings and action.default not in (None, False, [], "==SUPPRESS=="):
                # The option's help entry (up to the next option) names its default.
                entry = text.split(action.option_strings[-1], 1)[1].split("\n  -", 1)[0]
                assert "default" in entry, f"vlmserve {name} {action.option_strings[-1]}: no default in its help"


def test_an_unknown_command_is_named_with_a_suggestion() -> None:
    line = one_error_line(vlmserve("chatt", "hi"), 2)
    assert line.startswith("vlmserve: error: unknown command 'chatt'")
    assert "did you mean 'chat'?" in line


def test_a_mistyped_option_is_named_with_a_suggestion() -> None:
    line = one_error_line(vlmserve("serve", "--prot", "8000"), 2)
    assert line.startswith("vlmserve serve: error: unrecognized arguments: --prot")
    assert "did you mean '--port' for '--prot'?" in line
    assert "did you mean" not in one_error_line(vlmserve("serve", "--zzzzz"), 2)


def test_an_abbreviated_option_is_refused_not_guessed() -> None:
    line = one_error_line(vlmserve("chat", "--imag", str(SUNSET), "hi"), 2)
    assert line.startswith("vlmserve chat: error: unrecognized arguments: --imag")


def test_parsing_a_chat_command_line_imports_no_torch() -> None:
    """What is cheap to check is checked before torch is imported: --box-convention's choices
    (the registered families' conventions) are looked up only for a value given or the help."""
    code = (
        "import sys; from vlmserve.entrypoints.cli import command_parser; "
        "command_parser('chat').parse_args(['hi', '--draw-boxes', 'x.png']); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout == "False\n", result.stderr
    line = one_error_line(vlmserve("chat", "--box-convention", "qwen9-vl", "hi"), 2)
    assert "invalid choice: 'qwen9-vl' (choose from 'qwen2-vl', 'qwen2.5-vl', 'qwen3-vl', 'qwen-vl')" in line


@pytest.mark.parametrize(
    "argv",
    [["make-tiny"], ["make-tiny", "out", "--arch", "nope"], ["inspect"], ["inspect", "/no/such"],
     ["bench", "--num-requests", "0"], ["serve", "--port", "http"], ["chat", "--max-tokens", "-1"], ["worker"]],
    ids=" ".join,
)  # fmt: skip
def test_usage_errors_import_no_torch(argv: list[str]) -> None:
    """Every command's usage errors (a missing or wrong argument, a path with no config.json) are
    said before torch is imported, so they arrive at once (a few tens of ms), as a typo should."""
    code = (
        "import sys; from vlmserve.entrypoints.cli import main\n"
        f"try:\n    code = main({argv!r})\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout == "2 False\n", (result.stdout, result.stderr)
    assert len(result.stderr.splitlines()) == 1 and "error:" in result.stderr, result.stderr


def test_a_bad_option_value_is_named() -> None:
    line = one_error_line(vlmserve("serve", "--port", "70000"), 2)
    assert "argument --port: must be a TCP port, 1..65535, got 70000" in line


def test_a_missing_model_directory_is_one_line_before_loading(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    for command in (("chat", str(missing), "hi"), ("serve", str(missing)), ("bench", str(missing), "--no-hf")):
        line = one_error_line(vlmserve(*command), 2)
        assert line == (
            f"vlmserve {command[0]}: error: model '{missing}': no checkpoint directory there, and it is not a hub id "
            "(org/name)"
        )


def test_a_missing_image_is_one_line_before_loading(tiny_dir: Path) -> None:
    line = one_error_line(vlmserve("chat", str(tiny_dir), "--image", "/no/such.png", "hi"), 2)
    assert line == "vlmserve chat: error: --image /no/such.png: no such file"


def test_an_image_too_large_or_not_an_image_is_one_line_before_loading(tiny_dir: Path, tmp_path: Path) -> None:
    """The header is read before the model loads: its size against the limit, with the numbers."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    huge = tmp_path / "huge.png"  # a PNG header declaring 20000 x 20000 pixels (none follow)
    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
    huge.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"IEND", b""))
    line = one_error_line(vlmserve("chat", str(tiny_dir), "--image", str(huge), "hi"), 2)
    assert line == (
        f"vlmserve chat: error: --image {huge}: image is 20000x20000 = 400000000 pixels, over the 67108864 limit; "
        "give a smaller picture (up to 8192 x 8192)"
    )
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    line = one_error_line(vlmserve("chat", str(tiny_dir), "--image", str(text), "hi"), 2)
    assert line == f"vlmserve chat: error: --image {text}: cannot decode image (not one of BMP, GIF, JPEG, PNG, WEBP)"


def test_a_busy_port_is_one_line_before_loading(tiny_dir: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = one_error_line(vlmserve("serve", str(tiny_dir), "--port", str(port)), 1)
    assert line == (
        f"vlmserve serve: error: port {port} on 127.0.0.1 is already in use (another server?); stop it or choose "
        "another with --port"
    )


def test_an_engine_that_cannot_start_is_reported_at_once_not_restarted(tiny_dir: Path) -> None:
    """The engine process refuses the KV size after loading the model: the server says so and
    exits 1 (before: the engine was started 4 times, then the server waited 600 s)."""
    from tests.api.conftest import free_port

    result = vlmserve("serve", str(tiny_dir), "--port", str(free_port()), "--kv-cache-memory-gib", "1e-9")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "error:" in line]
    assert len(errors) == 2, result.stderr  # the engine's one line, and the command's
    assert "the engine cannot start: kv_cache_memory of 1 bytes holds no" in errors[0]
    assert errors[1].startswith("vlmserve serve: error: the engine did not start: the engine process exited (code 1)")
    assert result.stderr.count("loading weights") >= 1 and "restarting the engine" not in result.stderr


def _logged_ids(stderr: str) -> list[list[int]]:
    return [ast.literal_eval(ids) for ids in re.findall(r"prompt token ids (\[[\d, ]*\])", stderr)]


def test_a_conversation_through_a_pipe_keeps_the_first_turn_in_the_second_prompt(
    tiny_dir: Path, hf_tokenizer, hf_image_processor
) -> None:  # type: ignore[no-untyped-def]
    """Two turns: an image and a question, then a follow-up. The token ids the engine received
    for the second turn are those of the whole conversation (the first question, its image and
    the first answer, then the follow-up) as transformers renders and tokenizes it."""
    turns = f"/image {SUNSET}\nWhat is in this picture?\nAnd what colour is it?\n"
    args = ("chat", str(tiny_dir), "--max-tokens", "4", "--temperature", "0", "--dtype", "float32", "--debug")
    result = vlmserve(*args, stdin=turns)
    assert result.returncode == 0, result.stderr
    first_ids, second_ids = _logged_ids(result.stderr)
    (answer,) = re.findall(r"turn 1 answer: (.*)", result.stderr)
    answer = ast.literal_eval(answer)
    assert answer and result.stdout.startswith(answer + "\n")

    from PIL import Image

    grid = hf_image_processor(images=[Image.open(SUNSET).convert("RGB")], return_tensors="pt")["image_grid_thw"]
    image_tokens = int(grid.prod()) // 4

    def expected(messages: list[dict]) -> list[int]:
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = text.replace("<|image_pad|>", "<|image_pad|>" * image_tokens)
        return hf_tokenizer(text, add_special_tokens=False)["input_ids"]

    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}
    second = {"role": "user", "content": [{"type": "text", "text": "And what colour is it?"}]}
    assert first_ids == expected([first])
    assert second_ids == expected([first, {"role": "assistant", "content": answer}, second])
    assert second_ids[: len(first_ids)] == first_ids


def test_a_conversation_command_error_leaves_the_conversation_going(tiny_dir: Path) -> None:
    turns = "/image /no/such.png\n/nonsense\nhello\n"
    result = vlmserve("chat", str(tiny_dir), "--max-tokens", "2", "--dtype", "float32", "--debug", stdin=turns)
    assert result.returncode == 0, result.stderr
    assert "error: /image /no/such.png: no such file" in result.stderr
    assert "error: unknown command '/nonsense'; /help lists them" in result.stderr
    (ids,) = _logged_ids(result.stderr)
    assert 151655 not in ids  # no image went in
    assert result.stdout.strip()


def test_one_word_is_the_question_unless_it_names_a_model(tmp_path: Path) -> None:
    from vlmserve.model_files import looks_like_hub_id

    assert looks_like_hub_id("Qwen/Qwen2-VL-2B-Instruct")
    assert not any(looks_like_hub_id(q) for q in ("hello there", "2+2", "what is 1/2?", "./org/name", str(tmp_path)))


@pytest.mark.server
def test_serve_logs_one_banner_weight_progress_and_throughput_lines(tiny_dir: Path, tmp_path: Path) -> None:
    """The start-up log names what was built, once; weight loading shows progress; while a
    request runs the engine logs throughput lines."""
    import json
    import time

    from tests.api.conftest import start_server

    server = start_server(tiny_dir, tmp_path, "--log-level", "info", "--log-stats-interval", "0.5", api_key=None)
    try:
        log = server.log.read_text()
        config = json.loads((tiny_dir / "config.json").read_text())
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4  # float32
        # start_server's --kv-cache-memory-gib 0.05, capped at --max-num-seqs 16 x --max-model-len 4096
        blocks = min(int(0.05 * (1 << 30)) // (16 * per_token), 16 * 4096 // 16)
        port = server.url.rsplit(":", 1)[1]
        banner = {
            "model": f"{tiny_dir} (Qwen2VLForConditionalGeneration, Qwen2-VL)",
            "dtype": "float32",
            "max_model_len": "4096",
            "KV cache": f"{blocks * 16:,} tokens ({blocks:,} blocks of 16)",
            "serving": f"http://127.0.0.1:{port}/v1",
        }
        for name, value in banner.items():
            assert re.search(rf"INFO vlmserve\.api:   {re.escape(name)} +{re.escape(value)}$", log, re.MULTILINE), log
        assert log.count(f"vlmserve {version('vlmserve')} ready") == 1
        # Once each: the KV line, and the memory plan (the engine process used to log it, and the API process again).
        assert len(re.findall(r"  KV cache  ", log)) == 1 and len(re.findall(r"budget [\d.]+ GiB; weights", log)) == 1
        assert re.search(r"loading weights: 0/\d+ tensors", log) and "tensors (100%)" in log, log

        reply = server.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 16})
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 60
        rates: list[float] = []
        while not any(rates) and time.monotonic() < deadline:
            log = server.log.read_text()
            rates = [float(r) for r in re.findall(r"generation throughput: ([\d.]+) tokens/s", log)]
            time.sleep(0.2)
        assert any(rates), log
    finally:
        server.stop()
