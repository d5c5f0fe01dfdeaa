"""The chat page at / (vlmserve/api/web_ui.py, vlmserve/api/web/), in a real browser: headless
Chromium driven by selenium loads it from a real server, attaches a picture through the file
input, asks, and waits for the streamed answer. What the page shows is checked against what the
API answers to the same request: the text (greedy, so one answer), each picture's image tokens,
and grounding boxes drawn on the picture in its original pixels.

Needs Debian's `chromium` and `chromium-driver` (.ci/run installs them where it can); without
them the browser test is skipped, saying why. (The screenshots in docs/, web-ui.png and
web-ui-phone.png, are the demo checkpoint's: tests/tools/test_demo_model.py writes them into the
folder VLMSERVE_WEB_SCREENSHOTS names.)"""

from __future__ import annotations

import base64
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import API_KEY, Server
from vlmserve.api.serving import ServingContext
from vlmserve.grounding import parse_boxes, readable
from vlmserve.registry import grounding_convention

REPO = Path(__file__).resolve().parents[2]
PICTURE = REPO / "examples" / "sunset.png"
QUESTION = "What is in this picture?"
# A grounding answer forced on the random-weight model through the page's own "answer must match
# regex" setting (the request's structured_outputs.regex): JSON boxes, on the 0..1000 scale of
# the default checkpoint's convention.
FORCED = '[{"bbox_2d": [620, 300, 810, 610], "label": "sun"}]'


def test_page_is_served_open_with_a_content_security_policy(server: Server) -> None:
    import httpx

    page = httpx.get(server.url + "/", timeout=30)  # no API key: the page asks for it
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp
    assert '<script src="web/app.js"' in page.text  # relative: works below --root-path too
    script = httpx.get(server.url + "/web/app.js", timeout=30)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert ".innerHTML" not in script.text  # model text goes in as text only
    icon = httpx.get(server.url + "/web/favicon.svg", timeout=30)  # the page's <link rel="icon">
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert '<link rel="icon" href="web/favicon.svg"' in page.text and icon.text.startswith("<svg")
    # Only the page's own paths are open: the API still wants the key.
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server.url + "/web/other.js", timeout=30).status_code == 401


def _wait_for_ci_install() -> None:
    """.ci/run installs the browser in the background while pip works; it writes the file named
    by VLMSERVE_BROWSER_INSTALL_DONE when apt-get is finished (whatever its outcome)."""
    done = os.environ.get("VLMSERVE_BROWSER_INSTALL_DONE")
    deadline = time.monotonic() + 300
    while done and not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(1)


def _browser() -> Any:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra)")
    _wait_for_ci_install()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver (apt-get install -y ...)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,860"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for _console_errors
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))


def _set(browser: Any, element_id: str, value: str) -> None:
    element = browser.find_element("id", element_id)
    element.clear()
    element.send_keys(value)


def _open_page(browser: Any, wait: Any, url: str, api_key: str, model: str) -> None:
    """Load the page, give it the key, and wait until it has asked the server for its model."""
    browser.get(url + "/")
    _set(browser, "api-key", api_key)
    browser.find_element("id", "prompt").click()  # the key field's change event: the page asks for the model
    wait.until(lambda b: b.find_element("id", "model").text == model)


def _attach(browser: Any, wait: Any, picture: Path) -> None:
    """Attach a picture through the (hidden) file input; wait until it is shown pending."""
    file_input = browser.find_element("id", "file")
    browser.execute_script("arguments[0].hidden = false", file_input)
    file_input.send_keys(str(picture))
    browser.execute_script("arguments[0].hidden = true", file_input)
    wait.until(lambda b: b.find_elements("css selector", "#attachments .pending img"))


def _send(browser: Any, wait: Any, question: str, stop: bool = False) -> Any:
    """Send `question` (and, with `stop`, press Stop at once); the answer's message element once
    it has ended, however it ended."""
    before = len(browser.find_elements("css selector", ".message.assistant"))
    browser.find_element("id", "prompt").send_keys(question)
    browser.find_element("id", "send").click()
    if stop:
        browser.find_element("id", "stop-button").click()
    wait.until(
        lambda b: (
            len(b.find_elements("css selector", ".message.assistant[data-state]:not([data-state=streaming])")) > before
        )
    )
    return browser.find_elements("css selector", ".message.assistant")[-1]


def _ask(browser: Any, wait: Any, question: str) -> Any:
    """Send `question`; the finished answer's message element."""
    answer = _send(browser, wait, question)
    assert answer.get_attribute("data-state") == "done", answer.text
    return answer


def _console_errors(browser: Any) -> list[str]:
    """What the page logged as errors to the console since the last call (a failed load of its
    icon, a script error)."""
    return [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def _shows_what_the_model_can_be_asked(browser: Any, questions: tuple[str, ...]) -> None:
    """The empty conversation lists the model's example questions (GET v1/models); one clicked goes
    into the prompt box, unsent."""
    welcome = browser.find_element("id", "welcome")
    buttons = welcome.find_elements("css selector", ".examples button")
    assert [b.text for b in buttons] == list(questions)
    buttons[-1].click()
    prompt = browser.find_element("id", "prompt")
    assert prompt.get_attribute("value") == questions[-1]
    assert not browser.find_elements("css selector", ".message")
    prompt.clear()


def _fits_a_phone(browser: Any) -> None:
    """At a phone's width (390 CSS pixels) the page is one column that needs no sideways
    scrolling: the conversation full width, the settings hidden behind the header's Settings button
    and, shown, below the conversation. Back at the desktop width, the settings are beside it."""
    layout = (
        "const r = (id) => document.getElementById(id).getBoundingClientRect();"
        "const shown = (id) => getComputedStyle(document.getElementById(id)).display !== 'none';"
        "return {width: innerWidth, scroll: document.documentElement.scrollWidth, chat: r('chat'),"
        " settings: shown('settings') ? r('settings') : null, toggle: shown('settings-toggle'),"
        " widest: Math.max(...[...document.querySelectorAll('body *')].map((e) => e.getBoundingClientRect().right))}"
    )
    browser.set_window_size(390, 844)
    try:
        narrow = browser.execute_script(layout)
        assert narrow["width"] <= 400, narrow
        assert narrow["scroll"] <= narrow["width"] and narrow["widest"] <= narrow["width"] + 0.5, narrow
        assert narrow["chat"]["width"] == pytest.approx(narrow["width"], abs=1), narrow
        assert narrow["settings"] is None and narrow["toggle"], narrow
        browser.find_element("id", "settings-toggle").click()
        opened = browser.execute_script(layout)
        assert opened["settings"] is not None and opened["settings"]["top"] >= opened["chat"]["bottom"] - 1, opened
        assert opened["settings"]["width"] == pytest.approx(opened["width"], abs=1), opened
        assert opened["scroll"] <= opened["width"], opened
        browser.find_element("id", "settings-toggle").click()
    finally:
        browser.set_window_size(1280, 860)
    wide = browser.execute_script(layout)
    assert not wide["toggle"] and wide["settings"]["left"] >= wide["chat"]["right"] - 1, wide


# Answers in each convention's syntax (and the odd ones: swapped corners, past the edge, a quad,
# single-quoted JSON, cut short), for the page's parser against vlmserve.grounding's.
GROUNDING_CASES = [
    ("qwen2-vl", "<|object_ref_start|>dog<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>"),
    (
        "qwen2-vl",
        "<|box_start|>(300,400),(100,200)<|box_end|> and <|quad_start|>(1,2),(30,4),(50,60),(7,80)<|quad_end|>",
    ),
    ("qwen-vl", "<ref>cat</ref><box>(517,508),(589,611)</box>, <box>(1,2),(3,4)</box> then <box>(5,6),(7,8)</box>"),
    ("qwen2.5-vl", 'Here: [{"bbox_2d": [10, 20, 150, 90], "label": "a"}, {"point_2d": [50, 60]}]'),
    ("qwen3-vl", '```json\n[{"bbox_2d": [900, 800, 1200, 1100], "label": "edge"}]\n```'),
    ("qwen2-vl", "<|im_start|>a <|object_ref_start|>cat<|object_ref_end|><|box_start|>(1.5,2),(3,4)<|box_end|>, <|bo"),
    ("qwen2.5-vl", "{'bbox_2d': [1, 2, 300, 4], 'label': 'loose'} then [{\"bbox_2d\": [1, 2, 3"),
]


def _same_text_as_python(browser: Any) -> None:
    """The page shows answers as the terminal chat prints them (vlmserve.grounding.readable):
    finished, and at every length while one streams in."""
    for convention, text in GROUNDING_CASES:
        tags = grounding_convention(convention).tags
        shown = browser.execute_script(
            "return [...Array(arguments[0].length + 1).keys()].map("
            " (n) => readable(arguments[0].slice(0, n), arguments[1], false)).concat("
            " [readable(arguments[0], arguments[1], true)])",
            text,
            convention,
        )
        expected = [readable(text[:n], tags) for n in range(len(text) + 1)] + [readable(text, tags, complete=True)]
        assert shown == expected, text
    assert shown[-1] == "{'bbox_2d': [1, 2, 300, 4], 'label': 'loose'} then [{\"bbox_2d\": [1, 2, 3"  # JSON as written


def _same_boxes_as_python(browser: Any, original: tuple[int, int], resized: tuple[int, int]) -> None:
    for convention, text in GROUNDING_CASES:
        shown = browser.execute_script(
            "return parseBoxes(arguments[0], arguments[1], arguments[2], arguments[3])",
            text,
            convention,
            list(original),
            list(resized),
        )
        expected = parse_boxes(text, grounding_convention(convention), original, resized)
        assert [(b["label"], b["kind"]) for b in shown] == [(b.label, b.kind) for b in expected], text
        assert [[b[k] for k in ("x1", "y1", "x2", "y2")] for b in shown] == [
            pytest.approx(list(b.xyxy)) for b in expected
        ], text


def test_page_shows_the_api_answer_image_tokens_and_boxes(server: Server, tmp_path: Path) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser()
    try:
        wait = WebDriverWait(browser, 60)
        _open_page(browser, wait, server.url, API_KEY, "tiny")
        _set(browser, "temperature", "0")
        _set(browser, "max_tokens", "8")
        _attach(browser, wait, PICTURE)

        _shows_what_the_model_can_be_asked(browser, ServingContext.example_questions)
        answer = _ask(browser, wait, QUESTION)
        shown = browser.execute_script("return arguments[0].querySelector('.text').textContent", answer)
        raw = answer.get_attribute("data-text")
        url = "data:image/png;base64," + base64.b64encode(PICTURE.read_bytes()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
        greedy = {"model": "tiny", "temperature": 0, "max_tokens": 8, "skip_special_tokens": False}
        reference = server.post("/v1/chat/completions", greedy | {"messages": messages}).json()
        assert raw == reference["choices"][0]["message"]["content"] != ""
        assert shown == readable(raw, grounding_convention("qwen2-vl").tags, complete=True)
        (item,) = reference["usage"]["multimodal_tokens"]
        figure = browser.find_element("css selector", ".message.user .media-item")
        assert figure.get_attribute("data-tokens") == str(item["tokens"])
        assert f"{item['tokens']} tokens" in figure.text

        # A second turn, no new picture: the forced grounding answer's box goes on the first one.
        browser.find_element("css selector", "#settings summary").click()
        _set(browser, "regex", "".join("\\" + c if c in "[]{}" else c for c in FORCED))
        _set(browser, "max_tokens", "60")
        answer = _ask(browser, wait, "Where is the sun?")
        assert browser.execute_script("return arguments[0].querySelector('.text').textContent", answer) == FORCED
        width, height = item["original_size"]
        (mapped,) = parse_boxes(
            FORCED,
            grounding_convention(reference["vlmserve"]["grounding_convention"]),
            (width, height),
            tuple(item["resized_size"]),
        )
        expected = mapped.xyxy  # Python's mapping: (198.4, 60, 259.2, 122) in the 320 x 200 picture
        (box,) = answer.find_elements("css selector", ".grounding .box")
        assert box.text == "sun"
        assert tuple(float(box.get_attribute(f"data-{k}")) for k in ("x1", "y1", "x2", "y2")) == expected
        # Where it is drawn: the box's edges over the picture as shown, in the picture's own pixels.
        img, drawn = browser.execute_script(
            "const img = arguments[0].querySelector('.grounding img');"
            "const r = img.getBoundingClientRect(), b = arguments[1].getBoundingClientRect();"
            "return [[img.naturalWidth, img.naturalHeight, r.width], [b.left - r.left, b.top - r.top,"
            " b.right - r.left, b.bottom - r.top]];",
            answer,
            box,
        )
        assert img[:2] == [width, height]
        scale = img[0] / img[2]
        assert [v * scale for v in drawn] == pytest.approx(list(expected), abs=1.0)

        # The page's box parser and mapping (the functions that drew the box above) agree with
        # Python's on every syntax.
        _same_boxes_as_python(browser, (width, height), tuple(item["resized_size"]))
        _same_text_as_python(browser)

        assert browser.save_screenshot(str(tmp_path / "web-ui.png"))
        _fits_a_phone(browser)

        # The other two ways in: a picture dropped on the page, one pasted; each waits to be sent.
        browser.execute_script(
            "const file = () => new File([Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0))],"
            " 'x.png', {type: 'image/png'});"
            "const drop = new DataTransfer(); drop.items.add(file());"
            "document.body.dispatchEvent(new DragEvent('drop', {dataTransfer: drop, bubbles: true}));"
            "const paste = new DataTransfer(); paste.items.add(file());"
            "document.getElementById('prompt').dispatchEvent("
            " new ClipboardEvent('paste', {clipboardData: paste, bubbles: true}));",
            base64.b64encode(PICTURE.read_bytes()).decode(),
        )
        wait.until(lambda b: len(b.find_elements("css selector", "#attachments .pending img")) == 2)
    finally:
        browser.quit()


def test_a_failed_or_stopped_turn_is_left_out_of_the_conversation(server: Server) -> None:
    """As in the terminal chat: a turn refused (401), cut off by the network, or stopped is shown
    marked, and the next request carries none of it. A failed turn's words go back in the prompt
    box. The page loads without a console error (its icon included)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser()
    try:
        wait = WebDriverWait(browser, 60)
        _open_page(browser, wait, server.url, API_KEY, "tiny")
        _console_errors(browser)  # the first load asked for the model without the key: a 401
        browser.refresh()  # as a returning user: the key kept, the model found, the icon loaded
        wait.until(lambda b: b.find_element("id", "model").text == "tiny" and b.find_elements("id", "welcome"))
        assert _console_errors(browser) == []
        _set(browser, "temperature", "0")
        _set(browser, "max_tokens", "4")
        # Every request body the page sends, as it sends it.
        browser.execute_script(
            "window.sent = []; const f = window.fetch;"
            "window.fetch = (url, o) => { if (o && o.body) window.sent.push(JSON.parse(o.body)); return f(url, o); };"
        )
        prompt = browser.find_element("id", "prompt")

        _set(browser, "api-key", "not-the-key")
        refused = _send(browser, wait, "first question")
        assert refused.get_attribute("data-state") == "error" and "401" in refused.text, refused.text
        assert prompt.get_attribute("value") == "first question"  # back in the box, to send again
        prompt.clear()
        _set(browser, "api-key", API_KEY)

        browser.execute_script(  # the next question's request fails as a dropped connection does
            "const f = window.fetch;"
            "window.fetch = (url, o) => { if (!String(url).endsWith('chat/completions')) return f(url, o);"
            " window.fetch = f; return Promise.reject(new TypeError('Failed to fetch')); };"
        )
        cut = _send(browser, wait, "second question")
        assert cut.get_attribute("data-state") == "error" and "Failed to fetch" in cut.text, cut.text
        assert prompt.get_attribute("value") == "second question"
        prompt.clear()

        _set(browser, "max_tokens", "2000")
        stopped = _send(browser, wait, "third question", stop=True)
        assert stopped.get_attribute("data-state") == "stopped", stopped.text
        assert prompt.get_attribute("value") == ""  # stopped on purpose: nothing put back

        _set(browser, "max_tokens", "4")
        _ask(browser, wait, "fourth question")
        left_out = browser.find_elements("css selector", ".message.left-out")
        assert len(left_out) == 6  # each failed turn's question and answer
        answers = [m for m in left_out if "assistant" in m.get_attribute("class")]
        assert len(answers) == 3 and all("left out of the conversation" in m.text for m in answers)
        sent = browser.execute_script("return window.sent")
        assert [m["content"] for m in sent[-1]["messages"]] == [[{"type": "text", "text": "fourth question"}]]
        assert [m["content"][0]["text"] for m in sent[-2]["messages"]] == ["third question"]
    finally:
        browser.quit()
