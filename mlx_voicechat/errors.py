"""Errors with one clear line for the user (the CLI prints them without a traceback), and the
two type tests every argument check uses."""

import numbers


def is_int(x) -> bool:
    """An integer, but not a bool (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A real number, but not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class VoiceChatError(Exception):
    """Base class of the errors this package raises on bad input."""


class CheckpointError(VoiceChatError, ValueError):
    """A checkpoint folder, config or tensor that cannot be loaded."""


class GenerationError(VoiceChatError, ValueError):
    """Arguments of a generation run that cannot be used."""


class SessionError(VoiceChatError, ValueError):
    """A call a session cannot take: bad audio, a closed or finished session."""


class RequestError(GenerationError, SessionError):
    """A conversation's request that cannot be used (prompt, tools, seed, noise, max seconds,
    extra seconds, context): the same check for ``generate`` and for sessions, so it is both
    a GenerationError and a SessionError."""
