"""The networks and their blocks, each built from its section of :mod:`mlx_voicechat.config`:
``mel`` (the log-mel front end of both models), ``encoder`` (the one FastConformer),
``perception`` (mel + FastConformer + projection), ``rnnt`` (the transcript head and its greedy
step), ``llm`` (the dual-head Nemotron-H) with ``heads``, ``tts`` (EAR-TTS) with
``char_encoder``, ``codec`` (the audio codec), ``asr`` (Nemotron-3.5-ASR's networks); their
caches (``caches``), what is derived from the weights (``derived``), the fast-path registry
(``fastpaths``) and ``layout`` (the CPU weight layout of their Linear layers)."""
