"""A session is the one conversation of a batch of its own
(``nemotron_voicechat.runtime.session.Session`` is a
``nemotron_voicechat.runtime.handle.SessionHandle``); the session options are one list."""

import pytest

from mlx_voicechat.errors import SessionError
from mlx_voicechat.nemotron_voicechat.runtime.batch import SESSION_OPTIONS
from mlx_voicechat.nemotron_voicechat.runtime.handle import SessionHandle


def test_a_session_is_the_handle_of_its_own_batch(tiny):
    s = tiny.session(prompt=[1, 45, 2], seed=3)
    assert isinstance(s, SessionHandle)
    assert s.batch.sessions == [s] and s.batch.max_sessions == 1
    assert s.seed == 3 and s.prompt_ids == [1, 45, 2]
    events = s.silence(2)
    assert [e.index for e in events] == [0, 1] and s.frames == 2
    s.end("max_seconds")  # what the batch calls when a conversation stops taking input
    assert s.finished == "max_seconds"
    with pytest.raises(SessionError, match="has ended"):
        s.silence(1)
    s.close()
    assert s.closed and s.batch.sessions == []


@pytest.mark.parametrize("open_", ["session", "batch"])
def test_an_unknown_option_is_one_line(tiny, open_):
    with pytest.raises(SessionError) as e:
        if open_ == "session":
            tiny.session(temperature=0.5)
        else:
            tiny.session_batch().open(temperature=0.5)
    assert "temperature" in str(e.value) and "\n" not in str(e.value)
    assert all(name in str(e.value) for name in SESSION_OPTIONS)
