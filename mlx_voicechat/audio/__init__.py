"""The signal path both models share: ``io`` (reading, writing and checking audio), ``mel`` (the
one NeMo log-mel, offline and streaming, and the resampler), ``stream`` (``AudioIn``: samples to
mel windows), ``vad`` (speech start and stop on the input) and ``devices`` (microphone and
speaker)."""
