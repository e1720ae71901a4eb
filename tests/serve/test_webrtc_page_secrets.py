"""The web page and client secrets: the server's key never reaches the page.

Headless Chromium (the harness of tests/support/browser_harness.py, a WAV
file as its microphone) against the real server on the tiny random-weight checkpoint:

- a server with a key: the page without a secret says it needs one; the server's key typed in
  is refused by the page itself (never sent); a secret in the address's fragment
  (``#secret=ek_...``, as examples/client_secret_backend.py redirects) leaves the address bar,
  admits one WebRTC conversation and no second;
- a WebRTC call that was answered but never connected gives its secret back, so the page's
  WebSocket fallback connects with the same secret (and the server directly: aiortc);
- a server without a key: the page converses with no secret.
"""

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("aiortc")
pytest.importorskip("selenium")
websockets = pytest.importorskip("websockets")

from browser_harness import (  # noqa: E402, F401  (the browser tests' fixtures and helpers)
    API_KEY,
    CHROMIUM,
    CountingModel,
    chromium,
    client_secret,
    server,
    wait_for,
    write_microphone_wav,
)
from test_webrtc import KEY, offers, post, run, served, wait_idle  # noqa: E402, F401
from test_webrtc_browser import wait_free  # noqa: E402

browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium (apt-get install chromium chromium-driver)"
)


def talking(state) -> bool:
    return state["state"] == "connected" and state["framesReceived"] >= 8


def start(driver) -> None:
    driver.execute_script("document.getElementById('transport').value = 'webrtc'")
    driver.find_element("id", "start").click()


def stop(driver) -> None:
    driver.find_element("id", "stop").click()
    wait_for(driver, lambda s: s["state"] == "closed", 5, "the stopped state", ended=("error",))


def backend_redirect(url: str) -> str:
    """examples/client_secret_backend.py in front of the server at ``url``: its ``/start`` asks
    for the login, then answers a redirect to the page with a fresh secret (returned)."""
    import base64
    import sys
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from client_secret_backend import make_server

    httpd = make_server("127.0.0.1", 0, server=url, page=url + "/", key=API_KEY, login="u:p")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    start = f"http://127.0.0.1:{httpd.server_address[1]}/start"

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args):
            return None  # the redirect is the answer

    opener = urllib.request.build_opener(Stay)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(start, timeout=10)
        assert refused.value.code == 401  # no login, no secret
        login = {"Authorization": "Basic " + base64.b64encode(b"u:p").decode()}
        with pytest.raises(urllib.error.HTTPError) as redirect:
            opener.open(urllib.request.Request(start, headers=login), timeout=10)
        assert redirect.value.code == 303
        return redirect.value.headers["Location"]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@browser
def test_the_page_connects_with_a_client_secret_never_the_key(server, tmp_path):  # noqa: F811
    wav = write_microphone_wav(tmp_path / "mic.wav")
    driver = chromium(tmp_path / "profile", wav)
    try:
        # No secret: the server (it has a key) refuses, and the page says what it needs.
        driver.get(server.url + "/")
        start(driver)
        state = wait_for(driver, lambda s: s["state"] == "error", 20, "the refusal")
        assert "needs a client secret" in state["lastError"], state
        wait_free(server)

        # The server's key typed in: refused by the page, nothing sent.
        driver.get(server.url + "/")
        driver.find_element("id", "secret").send_keys(API_KEY)
        start(driver)
        state = wait_for(driver, lambda s: s["state"] == "error", 5, "the page's refusal")
        assert "never the server's API key" in state["lastError"], state
        assert state["transport"] is None, state  # no connection was tried

        # The example back-end's redirect: a secret in the fragment, out of the address bar,
        # one conversation over WebRTC.
        to = backend_redirect(server.url)
        secret = to.split("#secret=")[1]
        assert to == f"{server.url}/#secret={secret}" and secret.startswith("ek_"), to
        driver.get(to)
        assert driver.execute_script("return location.hash") == ""
        assert driver.current_url == server.url + "/"
        assert driver.find_element("id", "secret").get_attribute("value") == secret
        start(driver)
        state = wait_for(driver, talking, 60, "a WebRTC conversation with the secret")
        assert state["transport"] == "webrtc" and state["secretUsed"], state
        assert driver.find_element("id", "secret").get_attribute("value") == ""  # spent
        stop(driver)
        wait_free(server)

        # The same secret again (typed back in): used up.
        driver.execute_script("document.getElementById('secret').value = arguments[0]", secret)
        start(driver)
        state = wait_for(driver, lambda s: s["state"] == "error", 20, "the used secret refused")
        assert "already used" in state["lastError"], state
    finally:
        driver.quit()
    wait_free(server)


@browser
def test_a_call_that_never_connected_gives_the_page_its_secret_back(server, tmp_path):  # noqa: F811
    """The call is answered (the secret admitted it) but the page gives up before it connects
    (its connect timeout set to 1 ms): the hangup gives the secret back, and the page's
    WebSocket fallback converses with the same secret."""
    driver = chromium(tmp_path / "profile", write_microphone_wav(tmp_path / "mic.wav"))
    try:
        driver.get(f"{server.url}/#secret={client_secret(server.url, API_KEY)}")
        driver.execute_script("window.voicechat.webrtcConnectMs = 1")
        start(driver)
        state = wait_for(
            driver,
            lambda s: s["transport"] == "websocket" and talking(s),
            60,
            "the WebSocket fallback with the same secret",
        )
        assert "did not complete" in state["webrtcError"], state
        assert state["lastError"] is None and state["secretUsed"], state
        stop(driver)
    finally:
        driver.quit()
    wait_free(server)


def test_a_secret_whose_call_never_connected_admits_one_connection(served, offers):  # noqa: F811
    """aiortc's view of the same: the answered call holds the secret (a second offer with it is
    refused); hung up before it connected, the secret admits one WebSocket, then no other."""
    value = json.loads(
        post(
            served,
            "/v1/realtime/client_secrets",
            b"{}",
            {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )[2]
    )["value"]
    headers = {"Authorization": f"Bearer {value}", "Content-Type": "application/sdp"}
    status, answer, _ = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    assert status == 201
    status, _, body = post(served, "/v1/realtime/calls", offers[0].encode(), headers)
    assert status == 401 and "already used" in json.loads(body)["error"]["message"]
    auth = {"Authorization": f"Bearer {value}"}
    assert post(served, answer["location"] + "/hangup", b"", auth)[0] == 200
    wait_idle(served)
    url = served.url.replace("http", "ws") + "/v1/realtime"

    async def main():
        async with websockets.connect(url, additional_headers=auth) as ws:
            first = json.loads(await ws.recv())
        wait_idle(served)
        async with websockets.connect(url, additional_headers=auth) as ws:
            again = json.loads(await ws.recv())
        return first, again

    first, again = run(main())
    assert first["type"] == "session.created", first
    assert again["type"] == "error" and "already used" in again["error"]["message"], again
    wait_idle(served)


@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    """The page's server without an API key."""
    import mlx_voicechat
    from mlx_voicechat.factory import make_checkpoint
    from mlx_voicechat.serve.app import ServerThread, create_app

    root = tmp_path_factory.mktemp("keyless")
    counted = CountingModel(mlx_voicechat.load(make_checkpoint(root / "tiny", "tiny")))
    app = create_app(counted, model_id="tiny-random", max_sessions=1, stats_every_frames=5)
    with ServerThread(app) as s:
        yield s


@browser
def test_a_server_without_a_key_needs_no_secret(keyless, tmp_path):
    driver = chromium(tmp_path / "profile", write_microphone_wav(tmp_path / "mic.wav"))
    try:
        driver.get(keyless.url + "/")
        start(driver)
        state = wait_for(driver, talking, 60, "a WebRTC conversation without a secret")
        assert state["transport"] == "webrtc" and not state["secretUsed"], state
        assert state["lastError"] is None and state["webrtcError"] is None, state
        stop(driver)
    finally:
        driver.quit()
    wait_free(keyless)
