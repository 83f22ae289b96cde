"""The Web UI in a real headless Chromium (the distribution's, driven by selenium) against a real
`tandem serve` on the default model: streaming, conversations, edit and regenerate, stop (the
server's request is aborted), the API key, errors, and model text that must stay text.

The tests share one server and one browser and run in file order; the last one stops the
server. Each step's screenshot goes to a folder named in the failure message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="no browser installed: apt-get install chromium chromium-driver (.ci/run does)",
)

API_KEY = "webui-test-key"
SHOTS = Path(
    os.environ.get("TANDEM_WEBUI_SHOTS", Path(tempfile.gettempdir()) / "tandem-webui-shots")
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1100,800",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    # One sequence at a time and no queue: a second request while one runs gets a 429.
    cmd = [sys.executable, "-c", "from app.cli import main; raise SystemExit(main())", "serve"]
    cmd += ["--device", "cpu", "--port", str(port), "--api-key", API_KEY]
    cmd += ["--max-num-seqs", "1", "--max-queue", "0", "--max-model-len", "2048"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            pytest.fail(f"tandem serve did not start:\n{log.read().decode()[-3000:]}")
        time.sleep(0.25)
    yield base, proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^tandem:{name}(?:{{model_name=\"[^\"]*\"}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


class UI:
    """The page, with waits, and a screenshot per step."""

    def __init__(self, driver: Any, base: str) -> None:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.d = driver
        self.base = base
        self.By = By
        self.Wait = WebDriverWait
        self.dir = SHOTS
        self.n = 0

    def shot(self, name: str) -> None:
        self.n += 1
        self.d.save_screenshot(str(self.dir / f"{self.n:02d}-{name}.png"))

    @contextmanager
    def steps(self, test: str) -> Iterator[None]:
        self.dir = SHOTS / test
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.n = 0
        try:
            yield
            errors = [e for e in self.d.get_log("browser") if e.get("source") == "javascript"]
            assert not errors, f"errors in the page's scripts: {errors}"
        except BaseException as exc:
            console = ""
            try:
                self.shot("failure")
                console = "\n".join(str(e) for e in self.d.get_log("browser"))
            except Exception:  # the browser itself may be what failed
                pass
            raise AssertionError(
                f"{exc}\nbrowser console:\n{console}\n(screenshots of the steps: {self.dir})"
            ) from exc

    def wait(self, cond: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
        return self.Wait(self.d, timeout, poll_frequency=0.05).until(lambda _: cond(), message=what)

    def q(self, css: str) -> Any:
        return self.d.find_element(self.By.CSS_SELECTOR, css)

    def qq(self, css: str) -> list[Any]:
        return self.d.find_elements(self.By.CSS_SELECTOR, css)

    def js(self, script: str, *args: Any) -> Any:
        return self.d.execute_script(script, *args)

    def load(self, clear: bool = False) -> None:
        if clear:
            self.d.get(self.base + "/ui/style.css")  # same origin, so its storage can be set
            self.js(
                "localStorage.clear(); localStorage.setItem('tandem.apiKey', arguments[0])", API_KEY
            )
        self.d.get(self.base + "/")
        self.wait(lambda: self.js("return document.body.dataset.ready === '1'"), 30, "page ready")

    def settings(self, **values: Any) -> None:
        self.q("#toggle-settings").click()
        for key, value in values.items():
            field = self.q(f"#set-{key}")
            field.clear()
            field.send_keys(str(value))
        self.shot("settings")
        self.q("#toggle-settings").click()

    def type(self, text: str, enter: bool = True) -> None:
        from selenium.webdriver.common.keys import Keys

        box = self.q("#input")
        box.send_keys(text)
        if enter:
            box.send_keys(Keys.ENTER)

    def busy(self) -> bool:
        return self.q("#stop").is_displayed()

    def wait_reply(self, timeout: float = 90) -> Any:
        self.wait(lambda: not self.busy(), timeout, "the reply to finish")
        return self.qq("#messages .msg")[-1]

    def messages(self) -> list[tuple[str, str]]:
        return [
            (
                m.get_attribute("class").split()[1],
                m.find_element(self.By.CSS_SELECTOR, ".body").text,
            )
            for m in self.qq("#messages .msg")
        ]

    def open(self, title: str) -> None:
        [button] = [e for e in self.qq("#conv-list .conv-open") if e.text == title]
        button.click()
        self.wait(lambda: self.q("#conv-title").text == title, 5, f"conversation {title!r}")

    def titles(self) -> list[str]:
        return [e.text for e in self.qq("#conv-list .conv-open")]


@pytest.fixture(scope="module")
def ui(server: tuple[str, subprocess.Popen[bytes]]) -> Iterator[UI]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="tandem-webui-profile-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield UI(driver, server[0])
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_api_key_chat_streams_edit_regenerate_and_reload(ui: UI) -> None:
    with ui.steps("chat"):
        ui.d.get(ui.base + "/")  # no key stored yet: the page asks for it
        ui.wait(lambda: ui.q("#key-dialog").is_displayed(), 30, "the API key dialog")
        ui.shot("key-dialog")
        ui.q("#key-input").send_keys(API_KEY)
        ui.q("#key-ok").click()
        ui.wait(lambda: ui.js("return document.body.dataset.ready === '1'"), 30, "page ready")
        assert ui.js("return localStorage.getItem('tandem.apiKey')") == API_KEY
        assert ui.q("#model").get_attribute("value") == "smollm2-135m-instruct"

        ui.settings(max_tokens=64, temperature=0)
        # streamed: record the reply's length at each DOM change while the request still runs
        ui.js(
            "window.__lengths = [];"
            "new MutationObserver(() => {"
            "  const body = [...document.querySelectorAll('#messages .msg.assistant .body')].at(-1);"
            "  if (body && !body.querySelector('.typing') && !document.getElementById('stop').hidden)"
            "    window.__lengths.push(body.textContent.length);"
            "}).observe(document.getElementById('messages'),"
            "  {childList: true, subtree: true, characterData: true});"
        )
        ui.type("Describe the water cycle.")
        ui.wait(lambda: ui.qq("#messages .msg.assistant"), 10, "the reply to start")
        ui.shot("streaming")
        reply = ui.wait_reply()
        ui.shot("first-reply")
        partial = sorted({n for n in ui.js("return window.__lengths") if n})
        assert len(partial) >= 2, f"no streaming seen (lengths while running: {partial})"
        meta = reply.find_element(ui.By.CSS_SELECTOR, ".meta").text
        assert re.search(r"\d+ prompt tokens · \d+ cached · \d+ generated · TTFT \d+ ms", meta), (
            meta
        )
        assert len(ui.messages()[1][1]) > partial[0]
        assert meta.endswith("tok/s · max tokens reached") and "64 generated" in meta, meta
        first_answer = ui.messages()[1][1]
        assert first_answer.strip()

        ui.q("#new-chat").click()
        ui.type("Name a color.")
        ui.wait_reply()
        assert ui.titles() == ["Name a color.", "Describe the water cycle."]
        ui.shot("second-conversation")

        ui.open("Describe the water cycle.")
        assert ui.messages() == [
            ("user", "Describe the water cycle."),
            ("assistant", first_answer),
        ]
        ui.q('.msg[data-index="0"] .msg-edit').click()
        edit = ui.q(".edit-area")
        edit.clear()
        edit.send_keys("Describe the carbon cycle.")
        ui.shot("editing")
        ui.q(".msg-save").click()
        reply = ui.wait_reply()
        ui.shot("edited-and-regenerated")
        msgs = ui.messages()
        assert [m[0] for m in msgs] == ["user", "assistant"]
        assert msgs[0][1] == "Describe the carbon cycle." and msgs[1][1].strip()
        # the chat template's opening is shared with the first request: served from the cache
        cached = int(reply.find_element(ui.By.CSS_SELECTOR, ".meta").get_attribute("data-cached"))
        assert cached > 0

        ui.q(".msg-regenerate").click()
        ui.wait(lambda: ui.busy() or len(ui.messages()) == 2, 10)
        reply = ui.wait_reply()
        assert [m[0] for m in ui.messages()] == ["user", "assistant"]
        # the same conversation again: the whole prompt but its last block (16 tokens) reused
        meta = reply.find_element(ui.By.CSS_SELECTOR, ".meta")
        prompt = int(re.search(r"(\d+) prompt tokens", meta.text).group(1))
        assert int(meta.get_attribute("data-cached")) >= prompt - 16

        ui.type("an unsent draft", enter=False)
        ui.d.refresh()
        ui.wait(lambda: ui.js("return document.body.dataset.ready === '1'"), 30, "page ready")
        assert ui.q("#input").get_attribute("value") == "an unsent draft"
        assert not ui.q("#key-dialog").is_displayed()  # the key was kept
        ui.shot("after-reload")
        # the title followed the edited first question (it was never renamed)
        assert ui.titles() == ["Describe the carbon cycle.", "Name a color."]
        assert ui.messages()[0] == ("user", "Describe the carbon cycle.")

        ui.q("#conv-list li.active .conv-rename").click()
        ui.q(".conv-rename-input").send_keys("Capitals\n")  # the old name starts selected
        assert ui.titles()[0] == "Capitals" and ui.q("#conv-title").text == "Capitals"
        second = ui.qq("#conv-list li")[1]
        delete = second.find_element(ui.By.CSS_SELECTOR, ".conv-delete")
        ui.js("arguments[0].click(); arguments[0].click()", delete)
        ui.wait(lambda: ui.titles() == ["Capitals"], 5, "the deleted conversation gone")
        ui.shot("renamed-and-deleted")


def test_stop_aborts_the_request_and_errors_keep_the_input(ui: UI) -> None:
    from selenium.webdriver.common.keys import Keys

    with ui.steps("stop-and-errors"):
        ui.load(clear=True)
        ui.settings(max_tokens=1500, temperature=0)
        ui.type("Write a long story about a dragon and a knight.")
        ui.wait(lambda: len(ui.qq("#messages .msg.assistant .body")[-1].text) > 20, 60, "text")
        assert _metric(ui.base, "num_requests_running") == 1

        # a second conversation while the first streams: the server (one sequence, no queue)
        # answers 429, shown readably, and the typed text stays in the box
        ui.q("#new-chat").click()
        ui.type("Are you there?")
        ui.wait(lambda: ui.qq("#messages .msg.error"), 20, "the 429 error")
        ui.shot("busy-429")
        error = ui.q("#messages .msg.error").text
        assert "busy (429)" in error, error
        assert ui.q("#input").get_attribute("value") == "Are you there?"
        assert ui.messages() == [("error", error)]

        ui.open("Write a long story about a dragon and a knight.")
        assert ui.busy() and ui.q("#input").get_attribute("value") == ""
        ui.q("#input").send_keys(Keys.ESCAPE)
        ui.wait(lambda: not ui.busy(), 10, "the stop")
        ui.shot("stopped")
        meta = ui.q("#messages .msg.assistant .meta").text
        assert "stopped" in meta, meta
        deadline = time.monotonic() + 5
        while _metric(ui.base, "num_requests_running") or _metric(ui.base, "num_requests_admitted"):
            assert time.monotonic() < deadline, "the server still runs the stopped request"
            time.sleep(0.05)

        # the prompt too long for the context (2048): a readable error, the input kept
        ui.open("New chat")  # the failed question's title went back with it into the box
        assert ui.q("#input").get_attribute("value") == "Are you there?"  # its draft
        ui.q("#input").clear()
        ui.settings(max_tokens=4000)
        ui.type("Hello")
        ui.wait(lambda: ui.qq("#messages .msg.error"), 20, "the context error")
        error = ui.q("#messages .msg.error").text
        assert "no longer fits the model's context" in error, error
        assert ui.q("#input").get_attribute("value") == "Hello"
        ui.shot("context-error")

        # a refused key: the dialog asks again, and the request goes through with the new one,
        # carrying the conversation's settings
        ui.settings(max_tokens=8, system="Answer in French.", top_p=0.9, top_k=40, seed=7)
        ui.js(
            "window.__bodies = []; const send = window.fetch;"
            "window.fetch = (url, init) => {"
            "  if (init && init.body) window.__bodies.push(JSON.parse(init.body));"
            "  return send(url, init); };"
        )
        ui.js("localStorage.setItem('tandem.apiKey', 'wrong')")
        ui.q("#send").click()
        ui.wait(lambda: ui.q("#key-dialog").is_displayed(), 20, "the key dialog")
        assert "refused" in ui.q("#key-reason").text
        ui.q("#key-input").send_keys(API_KEY + "\n")
        ui.wait_reply()
        assert [m[0] for m in ui.messages()] == ["user", "assistant"]
        assert ui.js("return localStorage.getItem('tandem.apiKey')") == API_KEY
        body = ui.js("return window.__bodies.at(-1)")
        assert body["messages"] == [
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
        ]
        assert body["model"] == "smollm2-135m-instruct" and body["stream"] is True
        assert (body["max_tokens"], body["temperature"], body["top_p"]) == (8, 0, 0.9)
        assert (body["top_k"], body["seed"]) == (40, 7)


HOSTILE = (
    'Look: <script>window.__pwned = 1</script> and <img src=x onerror="window.__pwned = 2">'
    " and [click](javascript:window.__pwned=3) and <b>bold?</b>\n\n"
    "```html\n<script>window.__pwned = 4</script>\n```\n"
    "**strong** *em* `<i>code</i>` [site](https://example.com/a?b=c) https://example.org/x.\n\n"
    "| a | b |\n|---|:-:|\n| <u>x</u> | 2 |\n\n- one\n- two <iframe src=x>"
)


def test_model_text_is_never_html(ui: UI) -> None:
    with ui.steps("untrusted-text"):
        ui.load(clear=True)
        conversation = {
            "id": "hostile",
            "title": "<img src=x onerror=window.__pwned=5>",
            "created": 1,
            "updated": 2,
            "settings": {"system": "<script>window.__pwned=6</script>"},
            "messages": [
                {"role": "user", "content": '<img src=x onerror="window.__pwned = 7">'},
                {"role": "assistant", "content": HOSTILE, "stats": {"prompt_tokens": 3}},
            ],
        }
        ui.js(
            "localStorage.setItem('tandem.conversations.v1', arguments[0]);"
            "localStorage.setItem('tandem.current', 'hostile')",
            json.dumps([conversation]),
        )
        ui.load()
        ui.shot("rendered")
        assert ui.js("return window.__pwned") is None
        box = ui.q("#messages")
        assert not box.find_elements(ui.By.CSS_SELECTOR, "script, img, iframe, b, i, u")
        assert not ui.qq("#conv-list img")
        text = box.text
        assert "<script>window.__pwned = 1</script>" in text
        assert '<img src=x onerror="window.__pwned = 7">' in text
        assert "<iframe src=x>" in text and "<u>x</u>" in text
        assert ui.titles() == ["<img src=x onerror=window.__pwned=5>"]
        # Markdown still renders, from DOM nodes
        assert box.find_element(ui.By.CSS_SELECTOR, "strong").text == "strong"
        assert box.find_element(ui.By.CSS_SELECTOR, "em").text == "em"
        assert box.find_element(ui.By.CSS_SELECTOR, "p code").text == "<i>code</i>"
        links = box.find_elements(ui.By.CSS_SELECTOR, "a")
        assert [a.get_attribute("href") for a in links] == [
            "https://example.com/a?b=c",
            "https://example.org/x",
        ]
        assert [a.text for a in links] == ["site", "https://example.org/x"]
        assert len(box.find_elements(ui.By.CSS_SELECTOR, "table td")) == 2
        assert len(box.find_elements(ui.By.CSS_SELECTOR, "ul li")) == 2
        code = box.find_element(ui.By.CSS_SELECTOR, ".code-block pre code")
        assert code.text == "<script>window.__pwned = 4</script>"
        copy = box.find_element(ui.By.CSS_SELECTOR, ".code-block .copy")
        copy.click()
        ui.wait(lambda: copy.text in ("Copied", "Copy failed"), 5)

        # an imported file goes through the same cleaning; the export holds what was imported
        path = ui.dir / "import.json"
        conversation["id"], conversation["title"] = "imported", "Imported"
        path.write_text(json.dumps({"conversations": [conversation, {"messages": "junk"}]}))
        ui.q("#import").send_keys(str(path))
        ui.wait(lambda: ui.q("#conv-title").text == "Imported", 10, "the imported conversation")
        assert ui.js("return window.__pwned") is None
        assert len(ui.titles()) == 2
        ui.shot("imported")

        ui.js(
            "const create = URL.createObjectURL;"
            "URL.createObjectURL = (blob) => { window.__blob = blob; return create(blob); };"
            "HTMLAnchorElement.prototype.click = function () { window.__download = this.download; }"
        )
        ui.q("#export").click()
        name = ui.js("return window.__download")
        assert name.startswith("tandem-conversations-") and name.endswith(".json")
        exported = json.loads(
            ui.d.execute_async_script(
                "window.__blob.text().then(arguments[0], (e) => arguments[0](String(e)))"
            )
        )
        assert exported["format"] == "tandem-conversations"
        got = {c["id"]: c for c in exported["conversations"]}
        assert set(got) == {"hostile", "imported"}
        assert got["imported"]["messages"] == conversation["messages"]
        assert got["imported"]["settings"]["system"] == "<script>window.__pwned=6</script>"


MARKDOWN_CASES = [
    ("snake_case_name and 2 * 3 * 4", "<p>snake_case_name and 2 * 3 * 4</p>"),
    ("line one\nline two", "<p>line one<br>line two</p>"),
    ("# Title\ntext", "<h1>Title</h1><p>text</p>"),
    ("<b>x</b> &amp;", "<p>&lt;b&gt;x&lt;/b&gt; &amp;amp;</p>"),
    ("[a](javascript:alert(1)) [b](/relative)", "<p>a b</p>"),
    ("1. a\n2. b\n   - c", "<ol><li>a</li><li><p>b</p><ul><li>c</li></ul></li></ol>"),
    ("~~gone~~ `x<y`", "<p><del>gone</del> <code>x&lt;y</code></p>"),
    ("> quoted\n> more", "<blockquote><p>quoted<br>more</p></blockquote>"),
    ("**a** __b__ *c* _d_", "<p><strong>a</strong> <strong>b</strong> <em>c</em> <em>d</em></p>"),
    (
        "see http://x.org/a_b_c.",
        '<p>see <a href="http://x.org/a_b_c" rel="noopener noreferrer nofollow" '
        'target="_blank">http://x.org/a_b_c</a>.</p>',
    ),
    ("a\n\n---\n\nb", "<p>a</p><hr><p>b</p>"),
    (
        "| x | y |\n|---|--:|\n| 1 |",
        '<div class="table-wrap"><table><thead><tr><th>x</th>'
        '<th style="text-align: right;">y</th></tr></thead><tbody><tr><td>1</td></tr></tbody>'
        "</table></div>",
    ),
]


def test_markdown_renderer(ui: UI) -> None:
    with ui.steps("markdown"):
        ui.load(clear=True)
        script = (
            "const done = arguments[arguments.length - 1];"
            "import('/ui/markdown.js').then((md) => done(arguments[0].map((text) => {"
            "  const box = document.createElement('div');"
            "  box.append(md.renderMarkdown(text));"
            "  return box.innerHTML; })), (e) => done(String(e)));"
        )
        got = ui.d.execute_async_script(script, [text for text, _ in MARKDOWN_CASES])
        assert got == [html for _, html in MARKDOWN_CASES]
        # a fence still streaming (not closed yet) is already a code block with its copy button
        script = script.replace("box.innerHTML", "box.querySelector('pre code').textContent")
        assert ui.d.execute_async_script(script, ["```py\nx = 1\n  y"]) == ["x = 1\n  y"]


def test_phone_width_and_server_gone(ui: UI, server: tuple[str, subprocess.Popen[bytes]]) -> None:
    from selenium.webdriver.common.keys import Keys

    with ui.steps("phone-and-server-gone"):
        ui.d.set_window_size(390, 800)
        try:
            ui.load(clear=True)
            assert not ui.q("#sidebar").is_displayed() or ui.q("#sidebar").rect["x"] < 0
            ui.q("#toggle-sidebar").click()
            ui.wait(lambda: ui.q("#sidebar").rect["x"] >= 0, 5, "the sidebar drawer")
            ui.shot("phone-sidebar")
            ui.q("#new-chat").click()
            ui.wait(lambda: ui.q("#sidebar").rect["x"] < 0, 5, "the drawer closing")

            # the server dies mid-reply: what came is kept, and the loss is said
            ui.settings(max_tokens=1500)
            ui.type("Write a long story about a dragon and a knight.")
            ui.wait(lambda: len(ui.qq("#messages .msg.assistant .body")[-1].text) > 20, 60, "text")
            server[1].kill()
            server[1].wait(20)
            ui.wait(lambda: ui.qq("#messages .msg.error"), 20, "the lost connection")
            ui.shot("phone-server-died")
            assert "lost mid-reply" in ui.q("#messages .msg.error").text
            reply = ui.q("#messages .msg.assistant")
            assert len(reply.find_element(ui.By.CSS_SELECTOR, ".body").text) > 20
            assert reply.find_element(ui.By.CSS_SELECTOR, ".meta").text == "stopped"

            ui.q("#toggle-sidebar").click()
            ui.wait(lambda: ui.q("#sidebar").rect["x"] >= 0, 5, "the sidebar drawer")
            ui.q("#new-chat").click()
            ui.wait(lambda: ui.q("#sidebar").rect["x"] < 0, 5, "the drawer closing")
            ui.type("Anyone home?", enter=False)
            ui.q("#input").send_keys(Keys.SHIFT, Keys.ENTER)  # a new line, not a send
            ui.type("Hello?", enter=False)
            assert not ui.busy() and not ui.qq("#messages .msg")
            ui.q("#input").send_keys(Keys.ENTER)
            ui.wait(lambda: ui.qq("#messages .msg.error"), 20, "the connection error")
            ui.shot("phone-server-gone")
            assert "Cannot reach the server" in ui.q("#messages .msg.error").text
            assert ui.q("#input").get_attribute("value") == "Anyone home?\nHello?"
        finally:
            ui.d.set_window_size(1100, 800)
