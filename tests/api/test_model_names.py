"""Issue 13: a request's `model` must be a name the server serves, or be left out (then it means
the served model, as in vLLM). Any other name is a 404 in vLLM's words, answered before any work:
no media fetched or decoded, nothing sent to the engine. The served names default to the
checkpoint folder's name; `--served-model-name` gives one or more."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import Server, image_message, segments_left, start_server
from vlmserve.api.options import add_arguments
from vlmserve.api.protocol import APIError
from vlmserve.api.serving import ServingContext

PROMPT = [{"role": "user", "content": "Say something."}]
GREEDY = {"max_tokens": 4, "temperature": 0.0}


@pytest.fixture(scope="module")
def default_named(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server started without --served-model-name."""
    s = start_server(tiny_dir, tmp_path_factory.mktemp("names"), served_model_name=None)
    yield s
    s.stop()


def _engine_requests(server: Server) -> list[str]:
    """The API process's count of engine requests by outcome (every request that reached the
    engine is counted once it ends)."""
    text = server.get("/metrics").text
    return sorted(line for line in text.splitlines() if line.startswith("vlmserve_requests_total"))


def test_the_default_name_is_the_checkpoint_folder_and_a_request_may_give_it_or_leave_it_out(
    default_named: Server, tiny_dir: Path
) -> None:
    models = default_named.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [tiny_dir.name] == ["tiny-qwen2-vl"]
    named = default_named.post("/v1/chat/completions", {"model": tiny_dir.name, "messages": PROMPT, **GREEDY})
    assert named.status_code == 200, named.text
    assert named.json()["model"] == tiny_dir.name
    omitted = default_named.post("/v1/chat/completions", {"messages": PROMPT, **GREEDY})
    assert omitted.status_code == 200, omitted.text
    assert omitted.json()["choices"] == named.json()["choices"]
    completion = default_named.post("/v1/completions", {"model": tiny_dir.name, "prompt": "Hi", **GREEDY})
    assert completion.status_code == 200, completion.text


# A broken image: refused with a 400 if it were looked at; the unknown model is found first.
BROKEN_IMAGE = image_message("data:image/png;base64,!!!notbase64!!!")


@pytest.mark.parametrize(
    "name",
    ["tiny", "gpt-4o", "TINY-QWEN2-VL", "tiny-qwen2-vl ", "", "../tiny-qwen2-vl", "x" * 300],
    ids=["other-servers-name", "openai-name", "case-changed", "trailing-space", "empty", "path", "long"],
)
def test_an_unknown_model_gets_404_naming_it_before_any_work(default_named: Server, name: str) -> None:
    engine = default_named.engine_pid()
    before = _engine_requests(default_named)
    shown = name if len(name) <= 256 else name[:256] + "..."
    for path, body in [
        ("/v1/chat/completions", {"messages": PROMPT}),
        ("/v1/chat/completions", {"messages": BROKEN_IMAGE}),
        ("/v1/chat/completions", {"messages": PROMPT, "stream": True}),
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/completions", {"prompt": "Hi", "stream": True}),
    ]:
        response = default_named.post(path, {"model": name, **body, **GREEDY})
        assert response.status_code == 404, (path, body, response.text)
        assert response.json() == {
            "error": {
                "message": f"The model `{shown}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": "model_not_found",
            }
        }
    # Nothing reached the engine, nothing was written for it.
    assert _engine_requests(default_named) == before
    assert default_named.engine_pid() == engine and default_named.health() == 200
    assert segments_left() == []


@pytest.mark.parametrize(("name", "why"), [("\ud800", "lone surrogate"), ("a\x00b", "NUL"), (5, "string")])
def test_a_model_name_that_cannot_be_echoed_gets_400(default_named: Server, name: object, why: str) -> None:
    body = json.dumps({"model": name, "messages": PROMPT, **GREEDY})  # ASCII: a lone surrogate as \ud800
    response = default_named.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and why in error["message"], error


def test_served_model_name_takes_several_names_and_accepts_each() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["ckpt", "--served-model-name", "qwen2-vl", "qwen"])
    assert args.served_model_name == ["qwen2-vl", "qwen"]
    ctx = ServingContext(None, None, None, None, "qwen2-vl", served_model_names=("qwen2-vl", "qwen"))  # type: ignore[arg-type]
    for name in ("qwen2-vl", "qwen", None):
        ctx.check_model(name)
    with pytest.raises(APIError, match="The model `ckpt` does not exist.") as refused:
        ctx.check_model("ckpt")
    assert refused.value.status == 404
