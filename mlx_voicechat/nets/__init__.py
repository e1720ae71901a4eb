"""The networks and their blocks, each built from its section of :mod:`mlx_voicechat.config`:
``perception`` (mel + FastConformer + projection), ``rnnt`` (the transcript head), ``llm`` (the
dual-head Nemotron-H), ``tts`` (EAR-TTS) with ``char_encoder``, ``codec`` (the audio codec), and
``layout`` (the CPU weight layout of their Linear layers)."""
