"""VoiceChat's own networks, each built from its section of :mod:`mlx_voicechat.config`:
``perception`` (mel + FastConformer + projection), ``llm`` (the dual-head Nemotron-H),
``tts`` (EAR-TTS) with ``tts_backbone``, ``mog`` and ``char_encoder``, ``codec`` (the
audio codec) with ``codec_step``. The listening blocks are in :mod:`mlx_voicechat.listen`."""
