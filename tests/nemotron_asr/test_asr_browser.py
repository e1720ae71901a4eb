"""The web page's transcription mode in headless Chromium against a Nemotron-3.5-ASR server on
127.0.0.1: the page sees a transcription session, streams the microphone (a WAV file as the
fake capture device), shows the words as they come and ends the item on "End item". Skipped
only when no Chromium is installed (the browser test module's helpers drive it)."""

import pytest
from browser_harness import CHROMIUM, chromium, page_state, wait_for, write_microphone_wav

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from mlx_voicechat import load
    from mlx_voicechat.nemotron_asr.factory import make_recognizer_checkpoint
    from mlx_voicechat.serve.app import ServerThread, create_app

    # Seed 5 emits words on speech-like input (random recognizers often emit nothing).
    model = load(make_recognizer_checkpoint(tmp_path_factory.mktemp("asr-page") / "m", seed=5))
    with ServerThread(create_app(model, model_id="tiny-asr")) as s:
        yield s


def test_page_transcribes_with_a_recognizer(server, tmp_path):
    wav = write_microphone_wav(tmp_path / "mic.wav")
    driver = chromium(tmp_path / "profile", wav)
    try:
        driver.get(server.url + "/")
        assert page_state(driver)["state"] == "idle"
        driver.find_element("id", "start").click()
        state = wait_for(
            driver,
            lambda s: s["mode"] == "transcription" and s["framesSent"] >= 40 and s["userText"],
            60,
            "a transcription session and words",
        )
        assert state["lastError"] is None and state["framesReceived"] == 0, state
        assert driver.find_element("id", "interrupt").text == "End item"
        driver.find_element("id", "interrupt").click()  # commit: the item's whole transcript
        done = "return document.querySelectorAll('#user > div:not(.live)').length"
        wait_for(driver, lambda s: driver.execute_script(done) >= 1, 20, "the completed item")
        assert driver.find_element("id", "user").text.strip()
        assert page_state(driver)["lastError"] is None
    finally:
        driver.quit()
