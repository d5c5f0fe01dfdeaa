"""Chat templates other than the model's, as vLLM takes them: the server's --chat-template (a file
or the template inline), and a request's own `chat_template`, rendered only by a server started
with --trust-request-chat-template. Prompts are checked against transformers rendering the same
template; a template that does not parse or fails to render is a 400 naming its line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import transformers

from tests.api.conftest import Server, start_server

# Distinct from the model's (no system turn, roles in brackets), so a prompt shows which one ran.
SERVER_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
REQUEST_TEMPLATE = (
    "{% for m in messages %}<<{{ m.role | upper }}>>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<ASSISTANT>>{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def template_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("template-server")
    (tmp / "template.jinja").write_text(SERVER_TEMPLATE)
    s = start_server(tiny_dir, tmp, "--chat-template", str(tmp / "template.jinja"), "--trust-request-chat-template")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def rendered_ids(reference: transformers.PreTrainedTokenizerBase, template: str) -> list[int]:
    text = reference.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True, tokenize=False)
    return reference(text, add_special_tokens=False)["input_ids"]


def prompt_ids(server: Server, **fields: object) -> list[int]:
    body = {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True} | fields
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["prompt_token_ids"]


def test_the_servers_template_renders_every_request(template_server: Server, reference) -> None:  # type: ignore[no-untyped-def]
    expected = rendered_ids(reference, SERVER_TEMPLATE)
    assert reference.decode(expected).startswith("[user] What is the weather")
    assert prompt_ids(template_server) == expected
    tokenized = template_server.post("/tokenize", {"messages": MESSAGES}).json()
    assert tokenized["tokens"] == expected


def test_a_trusted_request_brings_its_own_template(template_server: Server, reference) -> None:  # type: ignore[no-untyped-def]
    expected = rendered_ids(reference, REQUEST_TEMPLATE)
    assert prompt_ids(template_server, chat_template=REQUEST_TEMPLATE) == expected
    tokenized = template_server.post("/tokenize", {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE}).json()
    assert tokenized["tokens"] == expected
    # Its chat_template_kwargs reach it.
    greeting = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    ids = prompt_ids(template_server, chat_template=greeting, chat_template_kwargs={"greeting": "Hello! "})
    assert reference.decode(ids) == "Hello! What is the weather in Paris?"


@pytest.mark.parametrize("stream", [False, True])
def test_a_template_that_fails_is_a_400_naming_its_line(template_server: Server, stream: bool) -> None:
    cases = [
        ("{% for m in messages %}\n{{ m.content }}\n{% endfr %}", "does not parse: line 3", "chat_template"),
        (
            "{% for m in messages %}\n{{ m.content }}\n{{ raise_exception('only system messages') }}\n{% endfor %}",
            "only system messages (template line 3)",
            "messages",
        ),
        ("{{ messages[0].content }}\n{{ messages.__class__.__mro__ }}", "(template line 2)", "messages"),
    ]
    for template, message, param in cases:
        body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": template, "stream": stream}
        response = template_server.post("/v1/chat/completions", body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["param"] == param, error
    assert template_server.health() == 200


def test_a_request_template_is_refused_unless_the_server_trusts_them(server: Server) -> None:
    """A template runs on the server: as vLLM, a request's own is refused (400 naming the flag)
    by a server not started with --trust-request-chat-template, whatever the endpoint."""
    for path in ("/v1/chat/completions", "/tokenize"):
        response = server.post(path, {"messages": MESSAGES, "max_tokens": 2, "chat_template": REQUEST_TEMPLATE})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "--trust-request-chat-template" in error["message"] and error["param"] == "chat_template"
    # Without one, the model's own template (its system turn first).
    response = server.post("/tokenize", {"messages": MESSAGES})
    assert response.status_code == 200
    assert "<|im_start|>system\n" in server.post("/detokenize", {"tokens": response.json()["tokens"]}).json()["prompt"]


def test_a_template_that_does_not_parse_stops_the_server_at_start(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "broken.jinja").write_text("ok\n{% if add_generation_prompt %}")
    s = start_server(tiny_dir, tmp_path, "--chat-template", str(tmp_path / "broken.jinja"), wait=False)
    try:
        assert s.process.wait(timeout=120) != 0
    finally:
        s.stop()
    log = s.log.read_text()
    assert "--chat-template" in log and "does not parse: line 2" in log, log[-2000:]
    with pytest.raises(httpx.HTTPError):
        httpx.get(s.url + "/health", timeout=2)
