"""Running the model: ``audio`` (reading and writing audio), ``duplex`` (the per-frame step and
offline generate), ``session`` (the streaming session, with ``frontend`` for incremental
listening and ``textstream`` for incremental text) and ``transcribe`` (the RNNT transcript)."""
