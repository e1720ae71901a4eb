"""Errors with one clear line for the user (the CLI prints them without a traceback)."""


class VoiceChatError(Exception):
    """Base class of the errors this package raises on bad input."""


class CheckpointError(VoiceChatError, ValueError):
    """A checkpoint folder, config or tensor that cannot be loaded."""
