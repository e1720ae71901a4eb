"""Turning a fast path (``mlx_voicechat.fastpaths``) on or off for one test."""

from mlx_voicechat import fastpaths


def set_fastpath(monkeypatch, name: str, on: bool) -> None:
    """``name`` on or off until the test ends (``monkeypatch`` restores it)."""
    assert name in fastpaths.PATHS, name
    off = set(fastpaths._global_off)
    if on:
        off.discard(name)
    else:
        off.add(name)
    monkeypatch.setattr(fastpaths, "_global_off", off)
