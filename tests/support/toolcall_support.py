"""What the tool-call tests (tests/nemotron_voicechat/runtime/test_tools.py, test_toolcalls.py) share: the tiny
checkpoint's tokenizer as the factory writes it (with and without the tool markers
<SPECIAL_16>..<SPECIAL_23>), a parser on it, a call as function-channel frames, and a feeder."""

import json
import re

import pytest
from transformers import PreTrainedTokenizerFast

from mlx_voicechat.nemotron_voicechat.runtime.tools import ToolCallParser, ToolMarkers
from mlx_voicechat.nemotron_voicechat.weights.factory import build_tokenizer

VOCAB = 400  # the tiny checkpoint's text vocabulary
PAD, SILENCE, BOS, EOS = 12, 11, 1, 2
MARKERS = [f"<SPECIAL_{i}>" for i in range(16, 24)]


def hf_tokenizer(path):
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def factory_json(tmp_path_factory):
    """The tiny checkpoint's tokenizer.json, as the factory writes it."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_tokenizer(VOCAB).save(str(path))
    return path


@pytest.fixture(scope="module")
def factory_tokenizer(factory_json):
    return hf_tokenizer(factory_json)


@pytest.fixture(scope="module")
def markerless_tokenizer(factory_json, tmp_path_factory):
    """The factory tokenizer with any <SPECIAL_16>..<SPECIAL_23> taken out."""
    data = json.loads(factory_json.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in MARKERS]
    vocab = data["model"]["vocab"]
    for token in MARKERS:
        vocab.pop(token, None)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return hf_tokenizer(path)


@pytest.fixture(scope="module")
def tok(factory_json):
    """The factory tokenizer with the tool markers <SPECIAL_16>..<SPECIAL_23> (added when the
    factory does not write them)."""
    t = hf_tokenizer(factory_json)
    t.add_special_tokens({"additional_special_tokens": MARKERS})
    assert all(m in t.get_vocab() for m in MARKERS)
    return t


@pytest.fixture(scope="module")
def markers(tok):
    return ToolMarkers.from_tokenizer(tok)


def make_parser(tok, markers, **kw):
    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    return ToolCallParser(markers, decode, pad_ids=(PAD, SILENCE), **kw)


def call_frames(tok, markers, text, pad_between=0):
    """The function channel of a call: start, the text's ids (pad between), end."""
    ids = []
    for i in tok.encode(text, add_special_tokens=False):
        ids += [i] + [PAD] * pad_between
    return [markers.start] + ids + [markers.end]


def run(parser, frames):
    """Feed one id per frame -> ([(frame, ToolCall)], [(frame, error)])."""
    calls, errors = [], []
    for n, i in enumerate(frames):
        c, e = parser.feed(i)
        calls += [(n, x) for x in c]
        errors += [(n, x) for x in e]
    return calls, errors


CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
