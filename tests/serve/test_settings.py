"""The server's one settings object (serve/settings.py): built once, read by the app and the
server, changed by name with a clear error for a name that is not a setting."""

import dataclasses

import pytest

from mlx_voicechat.config.voicechat import VoiceChatConfig
from mlx_voicechat.serve.settings import ServerSettings, model_id_of
from mlx_voicechat.serve.wire import FRAME_SECONDS, MODEL_INPUT_RATE, SAMPLES_PER_FRAME


def test_changes_by_name_and_unknown_names_are_a_type_error_that_lists_the_settings():
    base = ServerSettings(max_sessions=2)
    changed = base.replace(api_key="k", seed=3)
    assert (changed.max_sessions, changed.api_key, changed.seed) == (2, "k", 3)
    assert base.api_key is None and base.replace() is base
    with pytest.raises(TypeError, match=r"unknown server setting\(s\) \['max_session'\]") as e:
        base.replace(max_session=3)
    assert "max_sessions" in str(e.value) and "idle_timeout" in str(e.value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.max_sessions = 5


def test_one_spelling_of_each_setting():
    s = ServerSettings(api_key="", allow_origins=["https://a.example/"], idle_timeout=0)
    assert s.api_key is None and s.idle_timeout is None
    assert s.allow_origins == {"https://a.example"}
    assert ServerSettings(idle_timeout=30).idle_timeout == 30.0
    assert ServerSettings(mcp_allow=["http://h/"]).mcp_allow == ("http://h/",)
    for bad in ({"max_sessions": 0}, {"max_prompt_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerSettings(**bad)
    assert model_id_of("/models/tiny-ckpt/") == "tiny-ckpt" and model_id_of("org/m") == "m"


def test_create_app_reads_the_one_object_and_takes_changes_by_name():
    pytest.importorskip("fastapi")
    from mlx_voicechat.serve.app import create_app

    settings = ServerSettings(model_id="tiny", max_sessions=3, api_key="k")
    server = create_app(None, settings, warmup=False).state.server
    assert server.settings is settings
    assert (server.model_id, server.max_sessions, server.api_key) == ("tiny", 3, "k")
    server = create_app(None, settings, warmup=False, max_sessions=2).state.server
    assert server.max_sessions == 2 and server.model_id == "tiny"
    with pytest.raises(TypeError, match="unknown server setting"):
        create_app(None, warmup=False, max_sesions=2)


def test_the_frame_is_the_model_config_s():
    config = VoiceChatConfig()
    assert MODEL_INPUT_RATE == config.input_sample_rate
    assert SAMPLES_PER_FRAME == config.input_samples_per_frame
    assert FRAME_SECONDS == config.frame_duration
