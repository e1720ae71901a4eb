"""Running VoiceChat: ``request`` (a conversation's options, checked once), ``framestate`` (what
conversations carry between frames) and ``step`` (the one frame step), ``generate`` (offline),
``batch`` / ``handle`` / ``session`` (live conversations, with ``events``), ``compat`` (mlx-audio's
session classes), ``rnnt_transcription`` (live transcription on the RNNT head), the prompt chain,
tool calls and MCP, ``plot``."""
