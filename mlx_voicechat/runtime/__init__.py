"""Running the model: ``request`` (a conversation's options, checked once), ``framestate`` (what
conversations carry between frames) and ``step`` (the one frame step), ``generate`` (offline),
``batch`` / ``session`` (live conversations, with ``audioin`` and ``events``),
``transcribe`` (the RNNT transcript), ``audio`` (reading and writing audio) and ``textstream``
(incremental text)."""
