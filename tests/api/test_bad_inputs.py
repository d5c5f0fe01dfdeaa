"""../shared/BAD_INPUTS.md against the real server: each case asserts the status, an error in
OpenAI's shape that leaks nothing, /health still 200, and no vlmserve segment left in /dev/shm."""

from __future__ import annotations

import base64
import http.server
import io
import re
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from tests.api.conftest import API_KEY, Server, data_url, image_message, picture, segments_left
from tests.entrypoints.test_llm import PAD, chat_prompt
from tests.reference import hf_greedy, hf_logits, hf_prompt_ids
from vlmserve.api.json_limits import MAX_JSON_DEPTH

LEAKS = re.compile(r"Traceback|File \"|/work/|/tmp/|/home/|0x[0-9a-f]{6,}|site-packages|\bline \d+")


def check_error(server: Server, response: httpx.Response, status: int, match: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    message = body["error"]["message"]
    assert not LEAKS.search(message), message
    if match:
        assert re.search(match, message), message
    assert server.health() == 200
    assert segments_left() == []
    return body["error"]


def chat(server: Server, messages: list, **extra) -> httpx.Response:  # type: ignore[no-untyped-def]
    return server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, **extra})


def served_ok(server: Server) -> None:
    """A normal request right after still succeeds."""
    response = chat(server, image_message(data_url(picture(3)), "ok?"))
    assert response.status_code == 200, response.text


# -- fetching media --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def listener() -> Iterator[tuple[int, list[str]]]:
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], hits
    httpd.shutdown()


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "[::1]",
        "169.254.169.254",
        "10.1.2.3",
        "172.16.0.9",
        "192.168.1.1",
        "100.64.1.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "[::ffff:127.0.0.1]",
        "localhost",
        "user@127.0.0.1",
        "LOCALHOST.",
        "127.0.0.1.nip.io.invalid",
    ],
)
def test_private_media_urls_are_refused_and_never_hit(server: Server, listener, host: str) -> None:  # type: ignore[no-untyped-def]
    port, hits = listener
    before = len(hits)
    response = chat(server, image_message(f"http://{host}:{port}/x.png"))
    error = check_error(server, response, 400)
    assert error["param"] == "messages"
    assert len(hits) == before


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("file:///etc/passwd", "local files are not allowed"),
        ("/etc/passwd", "local files are not allowed"),
        ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
        ("gopher://example.com/a.png", "unsupported URL scheme 'gopher'"),
    ],
)
def test_local_and_other_schemes_are_refused_by_default(server: Server, url: str, match: str) -> None:
    check_error(server, chat(server, image_message(url)), 400, match)


# -- decoding images -------------------------------------------------------------------------------


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height but holds one tiny compressed row."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _b64(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:  # type: ignore[no-untyped-def]
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (_b64(_png_header(50_000, 50_000)), "too many pixels|pixels, over the"),
        (_b64(_png_header(0, 10)), "cannot decode image"),
        (_b64(_encode(Image.new("RGB", (1, 300)), "PNG")), r"aspect ratio 300.0 \(1x300\) exceeds the limit of 200"),
        (_b64(_encode(Image.new("RGB", (201, 1)), "PNG")), r"aspect ratio 201.0 \(201x1\) exceeds the limit of 200"),
        (_b64(_encode(picture(), "PNG")[:200]), "truncated or corrupt|cannot decode"),
        (_b64(b""), "data URL is empty"),
        (_b64(np.random.default_rng(0).bytes(4096)), "cannot decode image"),
        (_b64(_encode(picture(), "TIFF"), "image/tiff"), "cannot decode image"),
        (_b64(b"%PDF-1.4\n1 0 obj<<>>endobj\n", "application/pdf"), "cannot decode image"),
        (_b64(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "image/eps"), "cannot decode image"),
        (_b64(b"\x00\x00\x00\x0cjP  \r\n\x87\n" + b"\x00" * 64, "image/jp2"), "cannot decode image"),
        ("data:image/png;base64", "no comma"),
        ("data:image/png;base64,!!!notbase64!!!", "invalid base64"),
        ("data:image/png;base64,", "empty"),
    ],
)
def test_bad_images_are_refused(server: Server, payload: str, match: str) -> None:
    check_error(server, chat(server, image_message(payload)), 400, match)


def _animated(fmt: str) -> bytes:
    frames = [picture(seed=i, size=(40, 30)) for i in range(3)]
    return _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100)


def _translucent(mode: str) -> Image.Image:
    """picture() with alpha rising from 0 at the left edge to 255 at the right, in `mode`."""
    rgba = np.asarray(picture().convert("RGBA")).copy()
    rgba[..., 3] = np.linspace(0, 255, rgba.shape[1]).astype(np.uint8)[None, :]
    return Image.fromarray(rgba, "RGBA").convert(mode)


UNUSUAL_IMAGES = {
    "jpeg-declared-png": _b64(_encode(picture(), "JPEG"), "image/png"),  # the declared type lies: decoded by content
    "cmyk-jpeg": _b64(_encode(picture().convert("CMYK"), "JPEG"), "image/jpeg"),
    "16-bit-png": _b64(_encode(Image.fromarray(np.full((20, 30), 40000, dtype=np.uint16)), "PNG")),
    "palette-png": _b64(_encode(picture().convert("P"), "PNG")),
    "gray-alpha-png": _b64(_encode(picture().convert("LA"), "PNG")),
    "rgba-png": _b64(_encode(picture().convert("RGBA"), "PNG")),
    "translucent-rgba-png": _b64(_encode(_translucent("RGBA"), "PNG")),
    "translucent-gray-alpha-png": _b64(_encode(_translucent("LA"), "PNG")),
    "palette-png-with-a-transparent-colour": _b64(_encode(picture().convert("P"), "PNG", transparency=0)),
    "animated-gif": _b64(_animated("GIF"), "image/gif"),
    "apng": _b64(_animated("PNG")),
    "1x1": _b64(_encode(Image.new("RGB", (1, 1)), "PNG")),  # scaled up to min_pixels, as transformers does
    "1x200": _b64(_encode(picture(size=(1, 200)), "PNG")),  # the thinnest transformers accepts
}


@pytest.mark.parametrize("payload", list(UNUSUAL_IMAGES.values()), ids=list(UNUSUAL_IMAGES))
def test_unusual_but_valid_images_are_answered_as_transformers_answers_the_decoded_image(  # type: ignore[no-untyped-def]
    server: Server, payload: str, hf_model, hf_tokenizer, hf_image_processor
) -> None:
    """The reference: Pillow decodes the bytes (first frame, EXIF orientation), transformers'
    image processor makes it RGB (transparency onto white) and resizes it, transformers' model
    answers greedily."""
    question = "What is this?"
    response = chat(
        server, image_message(payload, question), max_tokens=3, temperature=0, logprobs=True, top_logprobs=5
    )
    assert response.status_code == 200, response.text
    assert segments_left() == []
    body = response.json()

    decoded = ImageOps.exif_transpose(Image.open(io.BytesIO(base64.b64decode(payload.split(",", 1)[1]))))
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, chat_prompt(PAD + question), [decoded])
    (item,) = body["usage"]["multimodal_tokens"]
    assert item["original_size"] == list(decoded.size)
    t, h, w = vision["image_grid_thw"][0].tolist()
    assert item["resized_size"] == [w * 14, h * 14] and item["tokens"] == t * h * w // 4
    assert body["usage"]["prompt_tokens"] == len(ids)

    expected = hf_greedy(hf_model, ids, vision, 3)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(expected)
    assert body["choices"][0]["message"]["content"] == hf_tokenizer.decode(expected, skip_special_tokens=True)
    reference = torch.log_softmax(hf_logits(hf_model, ids, vision)[-1].double(), dim=-1).topk(5)
    served = [top["logprob"] for top in content[0]["top_logprobs"]]
    assert served == pytest.approx(reference.values.tolist(), abs=1e-4)
    assert content[0]["token"] == hf_tokenizer.decode(expected[:1])


def test_exif_rotated_jpeg(server: Server) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    payload = _b64(_encode(picture(size=(120, 60)), "JPEG", exif=exif.tobytes()), "image/jpeg")
    response = chat(server, image_message(payload))
    assert response.status_code == 200
    (item,) = response.json()["usage"]["multimodal_tokens"]
    assert item["original_size"] == [60, 120]  # upright


# -- request validation ---------------------------------------------------------------------------


def test_too_many_images_and_too_long(server: Server) -> None:
    url = data_url(picture(4))
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 4
    check_error(server, chat(server, [{"role": "user", "content": parts}]), 400, "too many images: 4 given, at most 3")
    big = data_url(Image.new("RGB", (1800, 1700)))
    long_text = "word " * 400
    response = chat(server, image_message(big, long_text))
    check_error(server, response, 400, r"prompt needs \d+ tokens \(\d+ text \+ 3904 image\).*max_model_len=4096")
    served_ok(server)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 10**9}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"top_logprobs": 1000, "logprobs": True}, "top_logprobs"),
        ({"stop": ["x"] * 1000}, "stop"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 5}, "top_p"),
        ({"seed": 2**80}, "seed"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_out_of_range_parameters_fail_fast(server: Server, extra: dict, param: str) -> None:
    start = time.monotonic()
    error = check_error(server, chat(server, [{"role": "user", "content": "hi"}], **extra), 400)
    assert error["param"] == param
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2, 3]", None, None),
        (b'{"messages": "hi"}', "messages", None),
        (b'{"messages": []}', "messages", None),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
            "messages",
            "no image or URL",
        ),
        (b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}', "messages[0].content", "NUL"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content", "surrogate"),
        (b'{"messages": [{"role": 5, "content": "hi"}]}', "messages", "role must be a string"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}',
            "messages",
            "no audio input",
        ),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]}',
            "messages",
            r"content\[0\] \(video 1\): local files are not allowed",
        ),
    ],
)
def test_malformed_bodies_name_the_parameter(server: Server, body: bytes, param: str | None, match: str | None) -> None:
    response = server.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    error = check_error(server, response, 400, match)
    if param is not None:
        assert error["param"] == param


# Each route's body, with a field "x" (a field no schema defines is ignored) holding `nest`.
NESTED_BODIES = {
    "/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": %s}',
    "/v1/completions": '{"prompt": "hi", "max_tokens": 1, "x": %s}',
    "/invocations": '{"prompt": "hi", "max_tokens": 1, "x": %s}',
    "/tokenize": '{"prompt": "hi", "x": %s}',
}


@pytest.mark.parametrize("path", list(NESTED_BODIES))
def test_bodies_nested_past_the_bound_get_400_before_parsing(server: Server, path: str) -> None:
    """json_limits: a body nests at most MAX_JSON_DEPTH levels (the body's own object is one),
    whatever the interpreter's recursion limit; past it, a 400 before anything parses it."""
    engine = server.engine_pid()
    for n in (MAX_JSON_DEPTH, 5_000, 100_000):
        body = (NESTED_BODIES[path] % ("[" * n + "]" * n)).encode()
        response = server.post(path, content=body, headers={"content-type": "application/json"})
        check_error(server, response, 400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
    fits = (NESTED_BODIES[path] % ("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))).encode()
    response = server.post(path, content=fits, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert server.engine_pid() == engine


def test_a_schema_sent_as_json_text_is_held_to_the_bound(server: Server) -> None:
    """A JSON schema given as text (guided_json, structured_outputs.json) is parsed by the engine
    and its compiler: nested past MAX_JSON_DEPTH it is a 400 naming the field."""
    engine = server.engine_pid()
    n = MAX_JSON_DEPTH  # with the {} at its core: one level more than the bound
    deep = '{"type": "array", "items": ' * n + "{}" + "}" * n
    for field, value in (("guided_json", deep), ("structured_outputs", {"json": deep})):
        response = chat(server, [{"role": "user", "content": "hi"}], **{field: value})
        error = check_error(server, response, 400, f"nested more than {MAX_JSON_DEPTH} levels deep")
        assert error["param"] == field
    fits = '{"type": "array", "items": ' * (n - 1) + "{}" + "}" * (n - 1)
    assert chat(server, [{"role": "user", "content": "hi"}], guided_json=fits).status_code == 200
    assert server.engine_pid() == engine


def test_body_over_the_limit_is_413_before_parsing(server: Server) -> None:
    response = server.post(
        "/v1/chat/completions", content=b"x" * (33 * 1024 * 1024), headers={"content-type": "application/json"}
    )
    check_error(server, response, 413, "over the")


def raw_http(server: Server, request: bytes) -> tuple[int, bytes]:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data else 0
    return status, data


def test_oversized_headers_are_refused(server: Server) -> None:
    status, _ = raw_http(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert status in (400, 431)
    many = b"".join(f"X-H{i}: v\r\n".encode() for i in range(5000))
    status, _ = raw_http(server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert status in (400, 431)
    assert server.health() == 200


# -- authentication --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        None,
        "Bearer wrong",
        f"Bearer {API_KEY.upper()}",
        f"Bearer {API_KEY[:-1]}",
        f"Bearer {API_KEY}x",
        f"bearer{API_KEY}",
        API_KEY,
        f"Basic {API_KEY}",
        f"Bearer  {API_KEY}",  # padded inside the value (HTTP trims whitespace only at the ends)
        f"Bearer {API_KEY}\t{API_KEY}",
    ],
)
def test_bad_api_keys_get_401(server: Server, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}]},
        headers=headers,
        timeout=10,
    )
    check_error(server, response, 401, "API key")


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET //v1/models HTTP/1.1",
        b"GET /V1/models HTTP/1.1",
        b"GET /v1/models/ HTTP/1.1",
        b"GET /v1%2Fmodels HTTP/1.1",
        b"GET /v1/models? HTTP/1.1",
        b"POST /v1/chat/completions/ HTTP/1.1",
        b"GET /health/../v1/models HTTP/1.1",
    ],
)
def test_path_spellings_never_reach_an_inference_route_without_the_key(server: Server, request_line: bytes) -> None:
    status, _ = raw_http(server, request_line + b"\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
    assert status == 401
    # A path in the Host header is not this server's name: refused before the key is looked at.
    status, _ = raw_http(server, request_line + b"\r\nHost: x/v1/models?\r\nContent-Length: 0\r\n\r\n")
    assert status == 400  # invalid_host (tests/api/test_browser_guard.py)


def test_open_routes_expose_no_secret(server: Server) -> None:
    for path in ("/health", "/metrics"):
        response = httpx.get(server.url + path, timeout=10)
        assert response.status_code == 200 and API_KEY not in response.text


def test_served_after_all_of_that(server: Server) -> None:
    served_ok(server)
