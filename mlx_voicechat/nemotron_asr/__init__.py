"""NVIDIA's Nemotron-3.5-ASR (both checkpoint layouts) on the shared listening stack: ``config``
(with ``config_transformers``), ``network``, ``layout`` / ``loading`` / ``factory`` (its
checkpoints), ``transcribe`` (offline), ``session`` (live transcription, of either model) and
``recognizer`` (``Recognizer``, what :func:`mlx_voicechat.load` returns for it)."""
