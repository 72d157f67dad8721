"""`rvqtts serve`'s web page (rvqtts/serving/page) in a real browser, Debian's chromium driven by Playwright, against
real servers on the tiny checkpoints: it speaks as the audio streams in and shows the request's figures, downloads
the WAV it played, uploads and speaks a voice, shows the server's refusals as text (markup included), says so when
the server stops mid-stream, stays usable without the microphone, asks for the API key, cannot be driven from
another site, and the /docs page describes the API and tries a request.

The page's CSP forbids eval, which Playwright's wait_for_function needs: waits poll page.evaluate instead. Chrome
logs each 4xx answer as a console error, so only the tests that expect none check the console."""

from __future__ import annotations

import base64
import http.server
import io
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from helpers import running, serving, streamed_samples, wait_until

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = next((path for path in ("/usr/lib/chromium/chromium", "/usr/bin/chromium") if os.path.exists(path)), None)
if CHROMIUM is None:
    pytest.skip(
        "no chromium at /usr/lib/chromium/chromium or /usr/bin/chromium: `apt-get install chromium` (.ci/run does)",
        allow_module_level=True,
    )

# Audio plays without a gesture; the microphone is a fake one, granted only where a context's permissions say so.
ARGS = ["--autoplay-policy=no-user-gesture-required", "--use-fake-device-for-media-stream"]
WAIT = 60  # seconds any one wait here may take before its test fails saying what it waited for
KEY = "page-key"
TYPED_MARKUP = "<img src=x onerror=window.pwned=1>"
NAMED_MARKUP = "<img src=x onerror=alert(1)>"
NUMBER = re.compile(r"\d+\.\d\d( s)?")  # a figure as the page shows it
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "server-page.png"  # docs/server.md's: RVQTTS_SCREENSHOT=1
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served(tiny_dir):
    """A CustomVoice server."""
    with running(tiny_dir, max_chars=200) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def base_served(base_dir, tmp_path_factory):
    """A Base server keeping voices, with one voice, bea, uploaded."""
    folder = tmp_path_factory.mktemp("page")
    voices = folder / "voices"
    voices.mkdir()
    with running(base_dir, voices_dir=voices) as (url, engine):
        form = {"name": "bea"}
        added = httpx.post(url + "/v1/audio/voices", files={"audio_sample": noise(folder / "bea.wav", 2)}, data=form)
        assert added.status_code == 200, added.text
        yield url, engine, voices


def noise(path, seed: int = 1):
    """A 1.5 s recording the model clones (it refuses silent or shorter ones): (its file name, its bytes)."""
    soundfile.write(path, np.random.default_rng(seed).standard_normal(36000).astype(np.float32) * 0.1, 24000)
    return path.name, path.read_bytes()


class Elsewhere(http.server.BaseHTTPRequestHandler):
    """Another site's page: an empty one."""

    def do_GET(self):
        body = b'<!doctype html><title>elsewhere</title><link rel="icon" href="data:,">'
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def another_site():
    """The address of another site's page: another port of this machine (a page whose address the browser does not
    know as this machine's is refused the loopback address space before any request is sent, whatever the server)."""
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere) as site:
        threading.Thread(target=site.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{site.server_address[1]}/"
        finally:
            site.shutdown()


@contextmanager
def opened(browser, address: str, **context):
    """A page of a fresh browser context (`context`: new_context's options) at `address`; its `errors` list holds
    the console's errors and uncaught exceptions, its `dialogs` the alerts and prompts opened."""
    context = browser.new_context(**context)
    page = context.new_page()
    page.errors, page.dialogs = [], []
    page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
    page.on("pageerror", lambda error: page.errors.append(f"uncaught: {error}"))
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    try:
        page.goto(address)
        yield page
    finally:
        context.close()


def poll(page, expression: str, what: str):
    return wait_until(lambda: page.evaluate(expression), WAIT, what)


def voices_shown(page, count: int = 1) -> list[str]:
    poll(page, f"document.getElementById('voice').options.length >= {count}", "the voices to be listed")
    return page.eval_on_selector_all("#voice option", "options => options.map(option => option.value)")


def played(page) -> float:
    return page.evaluate("window.rvqttsPlayer.playedSeconds()")


def speak(page, text: str = "Hello from the page."):
    """Speak `text` with the page; its streamed response (the request in .request) once its status shows done."""
    page.fill("#text", text)
    with page.expect_response(lambda response: response.url.endswith("/v1/audio/speech")) as response:
        page.click("#speak")
    page.wait_for_selector("#status.ok, #status.error", timeout=WAIT * 1000)
    assert "ok" in page.get_attribute("#status", "class"), page.text_content("#status")
    return response.value


def figures_shown(page) -> None:
    for figure in ("#first-audio", "#rtf", "#codes-per-call", "#audio-seconds"):
        assert NUMBER.fullmatch(page.text_content(figure)), (figure, page.text_content(figure))


def test_the_page_loads_with_no_console_error(browser, served):
    url, engine = served
    with opened(browser, url + "/") as page:
        assert voices_shown(page, len(engine.voices())) == engine.voices()
        assert page.text_content("#model") == "Model: tiny (CustomVoice)"
        assert page.is_hidden("#api-key-form") and page.is_hidden("#voices-panel")
        assert page.get_attribute("footer a[href=docs]", "href") == "docs"
        assert page.errors == []


def test_speak_plays_the_streamed_audio_shows_its_figures_and_downloads_it_as_wav(browser, served, tmp_path):
    url, engine = served
    with opened(browser, url + "/", viewport={"width": 1000, "height": 800}) as page:
        voices_shown(page)
        page.fill("#seed", "7")
        streamed = speak(page)
        sent = streamed.request.post_data_json
        assert (sent["stream"], sent["stream_format"], sent["response_format"], sent["seed"]) == (True, "sse", "pcm", 7)
        samples = streamed_samples(streamed.body(), "sse")
        assert len(samples) > 24000 * 0.5
        start = wait_until(lambda: played(page) or None, WAIT, "the audio to play")
        wait_until(lambda: played(page) > start + 0.2, WAIT, "the audio to play on")
        figures_shown(page)
        assert page.text_content("#audio-seconds") == f"{len(samples) / 24000:.2f} s"
        assert page.text_content("#seed-used") == "7"
        screenshot = SCREENSHOT if os.environ.get("RVQTTS_SCREENSHOT") == "1" else tmp_path / "page.png"
        page.screenshot(path=screenshot)

        with page.expect_download() as download:
            page.click("#download")
        assert download.value.suggested_filename == "speech.wav"
        data = open(download.value.path(), "rb").read()
        assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
        audio, rate = soundfile.read(io.BytesIO(data), dtype="int16")
        assert rate == 24000 and np.array_equal(audio, samples)  # what was streamed and played
        assert page.errors == []


def test_markup_typed_as_text_is_spoken_as_text(browser, served):
    url, _ = served
    with opened(browser, url + "/") as page:
        voices_shown(page)
        assert speak(page, TYPED_MARKUP).request.post_data_json["input"] == TYPED_MARKUP
        assert page.input_value("#text") == TYPED_MARKUP
        assert page.evaluate("document.querySelectorAll('img').length") == 0
        assert page.evaluate("window.pwned") is None and page.errors == []


def test_a_server_stopped_mid_stream_shows_an_error(browser, tiny_dir):
    """The engine is held after the first piece of audio, the server stopped (as SIGTERM stops it, with one second
    to drain): the stream breaks and the page says so, ready to speak again, instead of waiting for ever."""
    with serving(tiny_dir, drain_seconds=1) as (url, engine, server), opened(browser, url + "/") as page:
        held, answer = threading.Event(), engine._answer

        def holding(index, item):
            answer(index, item)
            if isinstance(item, np.ndarray) and item.size:
                held.wait(WAIT)

        engine._answer = holding  # this server's engine is closed after this test
        try:
            voices_shown(page)
            page.fill("#text", "Hello, until the server stops.")
            page.click("#speak")
            wait_until(lambda: played(page) > 0, WAIT, "the first audio to play")
            assert page.text_content("#status") == "Speaking…"
            server.should_exit = True
            page.wait_for_selector("#status.error", timeout=WAIT * 1000)
        finally:
            held.set()
        assert "the server may have stopped" in page.text_content("#status")
        assert page.is_enabled("#speak") and page.is_disabled("#stop")


def test_a_voice_uploaded_from_a_file_is_then_spoken(browser, base_served, tmp_path):
    url, _, voices = base_served
    with opened(browser, url + "/") as page:
        voices_shown(page)
        assert page.is_visible("#voices-panel")
        page.fill("#voice-name", "cleo")
        page.set_input_files("#voice-file", tmp_path.joinpath(noise(tmp_path / "cleo.wav")[0]))
        page.click("#upload")
        page.wait_for_selector("#status.ok", timeout=WAIT * 1000)
        assert page.text_content("#status") == "The voice cleo is ready (x-vector-only, from 1.5 s of audio)."
        assert (voices / "cleo.safetensors").is_file()
        assert page.input_value("#voice") == "cleo"  # the new voice is chosen
        assert speak(page, "Cleo speaks.").request.post_data_json["voice"] == "cleo"
        figures_shown(page)
        assert page.errors == []


def upload(page, name: str, file: dict) -> str:
    """The message the page shows for an upload that the server refuses."""
    page.fill("#voice-name", name)
    page.set_input_files("#voice-file", file)
    page.click("#upload")
    page.wait_for_selector("#status.error", timeout=WAIT * 1000)
    assert page.evaluate("document.getElementById('status').children.length") == 0  # text only
    return page.text_content("#status")


def test_a_bad_file_shows_the_servers_message(browser, base_served):
    url, _, voices = base_served
    with opened(browser, url + "/") as page:
        voices_shown(page)
        message = upload(page, "bad", {"name": "bad.wav", "mimeType": "audio/wav", "buffer": b"not audio"})
        assert message.startswith("cannot read 'bad.wav' as audio"), message
        assert not (voices / "bad.safetensors").exists()


def test_a_voice_named_with_markup_is_refused_by_the_server_and_shown_as_text(browser, base_served, tmp_path):
    url, _, voices = base_served
    kept = sorted(voices.iterdir())
    with opened(browser, url + "/") as page:
        voices_shown(page)
        # the page's own check (the field's pattern) would stop it first: the server's rule is what is tried here
        page.evaluate("document.getElementById('voice-name').removeAttribute('pattern')")
        name, recording = noise(tmp_path / "r.wav")
        message = upload(page, NAMED_MARKUP, {"name": name, "mimeType": "audio/wav", "buffer": recording})
        assert message.startswith(f"`name` {NAMED_MARKUP!r}: 1 to 64 letters"), message
        assert page.evaluate("document.querySelectorAll('img').length") == 0 and page.dialogs == []
        assert NAMED_MARKUP not in voices_shown(page) and sorted(voices.iterdir()) == kept


def test_a_refused_microphone_leaves_the_page_usable(browser, base_served):
    url, *_ = base_served
    with opened(browser, url + "/") as page:  # no "microphone" permission: the browser refuses it
        voices_shown(page)
        page.click("#record")
        page.wait_for_selector("#status.error")
        assert page.text_content("#status").startswith("The microphone is not available (NotAllowedError")
        assert page.text_content("#record") == "Record"
        page.select_option("#voice", "bea")
        speak(page, "Still speaking.")
        wait_until(lambda: played(page) > 0, WAIT, "the audio to play")
        figures_shown(page)


def test_the_page_asks_for_the_api_key_and_speaks_once_it_is_given(browser, tiny_dir):
    with running(tiny_dir, api_key=KEY) as (url, _), opened(browser, url + "/") as page:
        page.wait_for_selector("#api-key-form", state="visible")
        assert "API key is needed" in page.text_content("#status")
        page.fill("#api-key", KEY)
        page.click("#api-key-save")
        voices_shown(page)
        assert page.is_hidden("#api-key-form")
        assert speak(page).request.headers["authorization"] == f"Bearer {KEY}"
        figures_shown(page)


def test_a_page_of_another_site_cannot_drive_the_server(browser, base_served, tmp_path):
    """A page of another origin (another port of this machine) may send requests to the server: a JSON speech request
    needs CORS's consent, which the server does not give (its preflight is refused, the request never sent), a plain
    text one is not JSON (415), and an uploaded form, which browsers send without asking, is refused for its Origin
    (403). Nothing is spoken or stored."""
    url, engine, voices = base_served
    kept, before = sorted(voices.iterdir()), dict(engine.accounting.counts)
    with another_site() as elsewhere, opened(browser, elsewhere) as page:
        # the statuses the browser saw, though it hands the page none of them (Chrome's own protocol: Playwright
        # reports no response that CORS blocks)
        statuses, devtools = [], page.context.new_cdp_session(page)
        devtools.on("Network.responseReceivedExtraInfo", lambda event: statuses.append(event["statusCode"]))
        devtools.send("Network.enable")
        outcomes = page.evaluate(
            """async ([url, recording]) => {
                const outcome = (sent) => sent.then((response) => response.status, (error) => error.name);
                const speech = (type) => ({method: "POST", headers: {"Content-Type": type},
                                           body: JSON.stringify({input: "Hello.", voice: "bea"})});
                const form = new FormData();
                form.append("name", "evil");
                const bytes = Uint8Array.from(atob(recording), (c) => c.charCodeAt(0));
                form.append("audio_sample", new Blob([bytes]), "r.wav");
                return [await outcome(fetch(url + "/v1/audio/speech", speech("application/json"))),
                        await outcome(fetch(url + "/v1/audio/speech", speech("text/plain"))),
                        await outcome(fetch(url + "/v1/audio/voices", {method: "POST", body: form}))];
            }""",
            [url, base64.b64encode(noise(tmp_path / "evil.wav")[1]).decode()],
        )
        assert outcomes == ["TypeError"] * 3  # the browser hands the page no answer
        wait_until(lambda: len(statuses) >= 3, WAIT, "the browser to see the server's answers")
        assert statuses == [405, 415, 403]  # the JSON's preflight refused, text/plain not JSON, the form's origin
    assert engine.accounting.counts == before and sorted(voices.iterdir()) == kept


def test_the_docs_page_describes_the_api_and_tries_a_speech_request(browser, served):
    url, engine = served
    with opened(browser, url + "/docs") as page:
        speech = "#post-v1-audio-speech"
        page.wait_for_selector(speech)
        rows = page.eval_on_selector_all(f"{speech} tbody tr", "rows => rows.map(row => row.innerText.split('\\t'))")
        fields = {row[0]: row[1:] for row in rows}
        assert fields["input"][:3] == ["string", "", "required"]
        assert fields["speed"][:3] == ["number", "≥ 0.25, ≤ 4", "none"]
        assert fields["seed"][:3] == ["integer", "≥ 0, ≤ 9223372036854775807", "0"]
        assert fields["response_format"][1:3] == ['"wav", "pcm", "flac", "mp3", "opus"', '"wav"']
        assert page.get_attribute("a[href='./']", "href") == "./"
        body = f"{speech} textarea"
        poll(page, f"document.querySelector('{body}').value.includes('voice')", "the example to name a voice")
        assert page.evaluate(f"JSON.parse(document.querySelector('{body}').value)") == {
            "input": "Hello.",
            "voice": engine.voices()[0],
        }
        page.click(f"{speech} .try button")
        page.wait_for_selector(f"{speech} .output audio", timeout=WAIT * 1000)
        assert page.get_attribute(f"{speech} .output audio", "src").startswith("blob:")
        assert page.text_content(f"{speech} .output p").startswith("200 OK · audio/wav")
        page.click("#get-v1-audio-voices .try button")
        page.wait_for_selector("#get-v1-audio-voices .output pre")
        assert '"vivian"' in page.text_content("#get-v1-audio-voices .output pre")
        assert page.errors == []
