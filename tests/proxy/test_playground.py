"""The chat playground in a real headless browser (Debian's chromium driven by Playwright), through the real proxy
to the real inference server on its mock backend."""

from __future__ import annotations

import json
import time

import pytest
import requests
from browser import open_playground, send, set_params, wait_answer_done
from proxy_helpers import ROOT, bearer, make_token, wait_idle

ARTIFACTS = ROOT / "test-artifacts"

# records, on every animation frame, the last answer's length and the status line (installed before sending)
SAMPLER = """() => {
  window.__lengths = []; window.__statuses = new Set();
  const tick = () => {
    const answers = document.querySelectorAll('#messages .assistant .text');
    const last = answers[answers.length - 1];
    window.__lengths.push(last ? last.textContent.length : 0);
    window.__statuses.add(document.getElementById('status').textContent);
    if (window.__lengths.length < 20000) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


@pytest.fixture(scope="module")
def model(inference_proxy) -> str:
    health = requests.get(inference_proxy.url + "/health", headers=bearer(make_token(admin=True)), timeout=10)
    return health.json()["model"]  # the details: an operator's token


@pytest.mark.timeout(180)
def test_chat_streams_the_servers_answer(context, inference_proxy, inference_server, model, capsys):
    requested = []
    context.on("request", lambda r: requested.append(r))
    token = make_token()
    page = open_playground(context, inference_proxy.url, token)
    assert page.locator("#model").input_value() == model
    set_params(
        page,
        system="Answer in one line.",
        temperature="0",
        **{"top-p": "0.9", "max-tokens": "60"},
        seed="7",
        stop="never appears",
    )
    prompt = page.locator("#prompt")
    prompt.fill("Hello")
    prompt.press("Shift+Enter")  # a new line, not a send
    page.keyboard.type("there, playground")
    assert prompt.input_value() == "Hello\nthere, playground"
    assert page.locator("#messages li").count() == 0
    page.evaluate(SAMPLER)
    prompt.press("Enter")
    note = wait_answer_done(page)
    answer = page.locator("#messages .assistant .text").first.text_content()

    lengths = page.evaluate("window.__lengths")
    growing = sorted({n for n in lengths if 0 < n < len(answer)})
    assert len(growing) >= 3, f"the answer did not grow over several frames: {lengths[:200]}"
    statuses = page.evaluate("[...window.__statuses]")
    assert any("first token after" in s and "tokens/s" in s for s in statuses), statuses

    messages = [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Hello\nthere, playground"},
    ]
    params = {"temperature": 0, "top_p": 0.9, "max_tokens": 60, "seed": 7, "stop": ["never appears"]}
    direct = requests.post(
        f"{inference_server.url}/v1/chat/completions", timeout=60, json={"model": model, "messages": messages, **params}
    ).json()
    assert answer == direct["choices"][0]["message"]["content"]
    usage = direct["usage"]
    assert note.text_content().startswith("Finished: length")
    assert f"{usage['prompt_tokens']} prompt tokens, 60 completion tokens" in note.text_content()
    assert "tokens/s" in note.text_content()

    # the second turn sends the whole conversation
    send(page, "And again?")
    wait_answer_done(page, 2)
    posts = [json.loads(r.post_data) for r in requested if r.method == "POST"]
    assert [m["role"] for m in posts[-1]["messages"]] == ["system", "user", "assistant", "user"]
    assert posts[-1]["messages"][2]["content"] == answer
    assert posts[-1]["stream"] is True and posts[-1]["seed"] == 7

    # the token lives in this tab's session storage only: no cookie, not in any URL
    assert page.evaluate("sessionStorage.getItem('playground.token')") == token
    assert context.cookies() == []
    assert all(token not in r.url for r in requested)
    assert {r.url.split("/")[2] for r in requested} == {f"127.0.0.1:{inference_proxy.port}"}  # nothing else

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "playground-chat.png"
    page.screenshot(path=str(shot))
    with capsys.disabled():  # shown in every run, not only a failing one
        print(f"\nscreenshot of the finished chat: {shot}")
    assert shot.stat().st_size > 10_000


@pytest.mark.timeout(120)
def test_stop_aborts_and_frees_the_row(context, inference_proxy, inference_server):
    page = open_playground(context, inference_proxy.url, make_token())
    set_params(page, **{"max-tokens": "1900"})  # 38 s at the mock's 50 tokens/s: longer than wait_idle waits
    send(page, "a long answer please")
    page.wait_for_function("() => (document.querySelector('#messages .assistant .text')?.textContent.length || 0) > 10")
    assert requests.get(inference_server.url + "/health", timeout=10).json()["open_sessions"] >= 1
    page.locator("#stop-button").click()
    note = wait_answer_done(page)
    assert note.text_content().startswith("Stopped by you")
    health = wait_idle(inference_server)
    assert health["open_sessions"] == 0 and health["rows_in_use"] == 0, health
    assert page.locator("#send").is_enabled() and not page.locator("#stop-button").is_visible()
    kept = page.locator("#messages .assistant .text").text_content()
    assert len(kept) > 10

    # "New chat" in the middle of an answer aborts it too and forgets the whole conversation
    send(page, "another long one")
    page.wait_for_function("() => document.querySelectorAll('#messages .assistant .text')[1]?.textContent.length > 10")
    page.locator("#new-chat").click()
    health = wait_idle(inference_server)
    assert health["open_sessions"] == 0 and health["rows_in_use"] == 0, health
    assert page.locator("#messages li").count() == 0 and page.locator("#send").is_enabled()
    requested = []
    page.on("request", lambda r: requested.append(r))
    set_params(page, **{"max-tokens": "5"})
    send(page, "fresh start")
    wait_answer_done(page)
    assert [m["role"] for m in json.loads(requested[-1].post_data)["messages"]] == ["user"]


@pytest.mark.timeout(120)
def test_wrong_token_asks_for_the_token_again(context, inference_proxy, model):
    page = open_playground(context, inference_proxy.url)
    page.locator("#token-input").fill(make_token(secret="not-the-proxy-secret-" + "x" * 40))
    page.locator("#token-input").press("Enter")
    reason = page.locator("#token-reason")
    reason.wait_for()
    assert "did not accept your token" in reason.text_content() and "signature" in reason.text_content()
    assert page.locator("#token-dialog").is_visible()
    assert page.evaluate("sessionStorage.getItem('playground.token')") is None

    # the right token works; one that expires later in the session brings the prompt back, message kept
    page.locator("#token-input").fill(make_token())
    page.locator("#token-input").press("Enter")
    page.wait_for_function("() => document.querySelector('#model').options.length > 0")
    expired = make_token(exp=int(time.time()) - 3600)
    page.evaluate("t => sessionStorage.setItem('playground.token', t)", expired)
    send(page, "still there?")
    reason.wait_for()
    page.wait_for_function("() => document.querySelector('#token-dialog').open")
    assert "token expired" in reason.text_content()
    assert page.locator("#prompt").input_value() == "still there?"
    assert page.locator("#messages li").count() == 0


@pytest.mark.timeout(120)
def test_team_limit_shows_the_wait_message(context, make_proxy, inference_server, model):
    limited = make_proxy(inference_server.url, "--max-concurrent-per-team", "1", "--retry-after", "7")
    page = open_playground(context, limited.url, make_token())
    with requests.post(
        f"{limited.url}/v1/chat/completions",
        headers=bearer(make_token()),
        stream=True,
        timeout=60,
        json={"model": model, "messages": [{"role": "user", "content": "hold"}], "stream": True, "max_tokens": 1500},
    ) as held:
        assert held.status_code == 200
        chunks = held.iter_content(chunk_size=None)  # kept referenced: a dropped iterator closes the stream
        next(chunks)  # the team's one slot is taken
        send(page, "may I?")
        page.wait_for_function("() => document.querySelector('#status').classList.contains('error')")
        status = page.locator("#status").text_content()
        assert "Please wait 7 seconds and send again" in status, status
        assert "no room for 1 more of its limit of 1 open rows" in status
    assert page.locator("#prompt").input_value() == "may I?"  # the message is kept to send again
    wait_idle(inference_server)


@pytest.mark.timeout(120)
def test_broken_stream_keeps_what_arrived(context, inference_proxy, model):
    page = open_playground(context, inference_proxy.url, make_token())
    cut = (
        'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
        'data: {"choices":[{"index":0,"delta":{"content":"Half an ans"}}]}\n\n'
    )
    # the connection ends after two events: no finish reason, no [DONE]
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=cut),
    )
    send(page, "hello")
    note = wait_answer_done(page)
    assert "closed before the answer was complete" in note.text_content()
    assert "What arrived is kept" in note.text_content()
    assert page.locator("#messages .assistant .text").text_content() == "Half an ans"


@pytest.mark.timeout(120)
def test_busy_server_says_how_long_to_wait(context, inference_proxy, model):
    page = open_playground(context, inference_proxy.url, make_token())
    body = json.dumps({"error": {"message": "the server is at capacity", "type": "server_error"}})
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=503, headers={"Content-Type": "application/json", "Retry-After": "3"}, body=body
        ),
    )
    send(page, "anyone?")
    page.wait_for_function("() => document.querySelector('#status').classList.contains('error')")
    assert page.locator("#status").text_content() == (
        "The server is busy (the server is at capacity). Please wait 3 seconds and send again."
    )
    assert page.locator("#prompt").input_value() == "anyone?" and page.locator("#messages li").count() == 0


@pytest.mark.timeout(120)
def test_phone_sized_screen(browser, inference_proxy, model):
    context = browser.new_context(viewport={"width": 360, "height": 640}, is_mobile=True, has_touch=True)
    context.set_default_timeout(30_000)
    try:
        page = open_playground(context, inference_proxy.url, make_token())
        set_params(page, **{"max-tokens": "120"})
        send(page, "a phone-sized question that is long enough to wrap over several lines on a small screen")
        wait_answer_done(page)
        assert page.evaluate("document.documentElement.scrollWidth") <= 360  # nothing wider than the screen
        for control in ("#prompt", "#send", "#model", "#new-chat", "#change-token"):
            box = page.locator(control).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 360, (control, box)
    finally:
        context.close()


def test_page_and_assets_need_no_token_but_nothing_else_changes(inference_proxy):
    for path in ("/", "/playground", "/playground/app.js", "/playground/style.css"):
        response = requests.get(inference_proxy.url + path, timeout=10)
        assert response.status_code == 200, path
        assert "connect-src 'self'" in response.headers["Content-Security-Policy"]
        assert "://" not in response.text  # nothing from another host
        again = requests.get(
            inference_proxy.url + path, headers={"If-None-Match": response.headers["ETag"]}, timeout=10
        )
        assert again.status_code == 304
    for method, path in (
        ("POST", "/"),
        ("GET", "/playground/"),
        ("GET", "/playground/other.js"),
        ("POST", "/playground"),
        ("OPTIONS", "/"),
    ):
        response = requests.request(method, inference_proxy.url + path, timeout=10)
        assert response.status_code == 401, (method, path)
    assert (
        requests.post(
            inference_proxy.url + "/",
            headers=bearer(make_token()),
            timeout=30,
            json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
        ).status_code
        == 200
    )
