"""The split greedy head (nets.heads): the same id as the one-call head, bit for bit."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_voicechat.nets import heads
from mlx_voicechat.nets.layout import use_cpu_layout
from mlx_voicechat.runtime import duplex


def _head(rows, hidden, quantize=None, bias=False, seed=0):
    mx.random.seed(seed)
    head = nn.Linear(hidden, rows, bias=bias)
    if quantize:
        head = nn.QuantizedLinear.from_linear(head, group_size=32, bits=quantize)
    return head


def _inputs(hidden, n=16, seed=1):
    return mx.random.normal((n, 1, 1, hidden), key=mx.random.key(seed))


@pytest.mark.parametrize("quantize", [None, 4, 8])
@pytest.mark.parametrize("rows", [1000, 1001])
def test_split_equals_one_call(quantize, rows):
    head = _head(rows, 64, quantize)
    split = mx.new_stream(mx.default_device())
    for h in _inputs(64):
        one = mx.argmax(head(h), axis=-1).reshape(-1).astype(mx.int32)
        two = heads.greedy_id(head, h, split)
        assert two.dtype == mx.int32 and two.shape == (1,)
        assert two.item() == one.item()
        # every logit is the same, not just the winner
        half = rows // 2
        joined = mx.concatenate(
            [heads._rows(head, h, 0, half), heads._rows(head, h, half, rows)], axis=-1
        )
        assert mx.array_equal(joined, head(h)).item()


def test_split_with_bias_and_column_major_weight():
    head = _head(900, 32, bias=True)
    holder = nn.Module()
    holder.head = head
    use_cpu_layout(holder)  # not marked split_head: column-major data, the halves are copies
    split = mx.new_stream(mx.default_device())
    for h in _inputs(32):
        assert mx.array_equal(heads.greedy_id(head, h, split), mx.argmax(head(h), -1).reshape(-1))
        assert mx.array_equal(
            mx.concatenate([heads._rows(head, h, 0, 450), heads._rows(head, h, 450, 900)], -1),
            head(h),
        ).item()


def test_ties_keep_the_first_row():
    head = nn.Linear(4, 10, bias=False)
    head.weight = mx.ones((10, 4))  # every logit equal: the argmax is row 0 either way
    h = mx.ones((1, 1, 4))
    assert heads.greedy_id(head, h, mx.new_stream(mx.default_device())).item() == 0
    head.weight = mx.concatenate([mx.zeros((7, 4)), mx.ones((3, 4))])  # first max in the 2nd half
    assert heads.greedy_id(head, h, mx.new_stream(mx.default_device())).item() == 7


def test_the_text_head_is_marked_and_split_only_when_big(tiny, monkeypatch):
    stt = tiny.stt_model
    # the CPU layout leaves the text head row-major (its halves are views), not the other head
    assert getattr(stt.lm_head, "_keep_row_major", False)
    assert not getattr(stt.function_head, "_keep_row_major", False)
    assert not heads.should_split(stt.lm_head)  # 400 rows
    monkeypatch.setattr(heads, "SPLIT_MIN_ROWS", 400)
    assert heads.should_split(stt.lm_head)
    assert duplex.head_stream() is duplex.head_stream()
    assert duplex.head_stream() != duplex.speech_stream()
