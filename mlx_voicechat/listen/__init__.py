"""The listening stack both models share: ``fastconformer`` (the one FastConformer encoder),
``rnnt`` (prediction network, joint, the per-frame greedy step), ``greedy`` (the one batched greedy
RNN-T decoder), ``transcribe`` (an utterance's transcript), ``textstream`` and ``events``
(incremental transcript text and the transcription events)."""
