"""Incremental decoding of the per-frame channels, O(1) work per token: :class:`TextStream`
(the tokenizer's streaming decoder; its deltas add up to ``generate.reply_text``) and
:class:`TranscriptStream` (RNNT pieces; they add up to ``rnnt.decode_pieces``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Set

from .rnnt import WORD_BOUNDARY, read_piece


def dropped_ids(config) -> Set[int]:
    """The ids that are no text of a reply: pad, silence, bos and eos (spec step 7)."""
    return {config.pad_token_id, config.silence_token_id, config.bos_token_id, config.eos_token_id}


class TextStream:
    def __init__(self, model, config):
        self.tokenizer = model.tokenizer
        self.drop = dropped_ids(config)
        self._stream = None
        self._backend = None
        self._ids = []  # only without a streaming decoder: the kept ids so far
        self._held = []  # ids the streaming decoder holds back (an incomplete character)
        self._text = ""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            try:
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(skip_special_tokens=False)
                self._backend = backend
            except ImportError:  # tokenizers < 0.21
                pass

    def add(self, token_id: int) -> str:
        """The text this id adds (may be "" while a multi-byte character is incomplete)."""
        if token_id in self.drop or self.tokenizer is None:
            return ""
        if self._stream is not None:
            text = self._stream.step(self._backend, int(token_id))
            if text is None:  # an incomplete character: held until its last byte
                self._held.append(int(token_id))
                return ""
            self._held = []
            return text
        # A tokenizer without a streaming decoder: decode the kept ids and diff.
        self._ids.append(int(token_id))
        text = self.tokenizer.decode(self._ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta

    def flush(self) -> str:
        """At the end of the stream: what offline decoding makes of the held-back ids (the
        replacement character of an incomplete one)."""
        if self._stream is not None:
            held, self._held = self._held, []
            return self.tokenizer.decode(held, skip_special_tokens=False) if held else ""
        if self._ids and self.tokenizer is not None:
            text = self.tokenizer.decode(self._ids, skip_special_tokens=False)
            delta, self._text = text[len(self._text) :], text
            return delta
        return ""


class TranscriptStream:
    """The user's words from RNNT ids: pieces joined, ``▁`` as a space, specials and language
    tags dropped, no leading or trailing space (a space is held back until a word follows)."""

    def __init__(self, vocabulary: Sequence[str]):
        self.vocabulary = vocabulary
        self.language: Optional[str] = None
        self._started = False
        self._held = ""

    def add(self, token_id: int) -> str:
        piece, tag = read_piece(self.vocabulary, token_id)
        self.language = tag or self.language
        if piece is None:
            return ""
        text = self._held + piece.replace(WORD_BOUNDARY, " ")
        if not self._started:
            text = text.lstrip()
            if not text:
                self._held = ""
                return ""
            self._started = True
        body = text.rstrip()
        self._held = text[len(body) :]
        return body
