"""The split greedy head (fastpaths.heads): the same id as the one-call head, bit for bit."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_voicechat.fastpaths import heads
from mlx_voicechat.fastpaths.layout import use_cpu_layout
from mlx_voicechat.nemotron_voicechat.runtime import step


def _head(rows, hidden, quantize=None, bias=False, seed=0):
    mx.random.seed(seed)
    head = nn.Linear(hidden, rows, bias=bias)
    if quantize:
        head = nn.QuantizedLinear.from_linear(head, group_size=32, bits=quantize)
    return head


def _half_head():
    head = _head(400, 32)
    head.weight = head.weight.astype(mx.bfloat16)
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
    use_cpu_layout(holder)  # column-major data: a row slice is strided
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


def test_only_big_heads_whose_halves_are_views_are_split(tiny_checkpoints, monkeypatch):
    from mlx_voicechat import load

    q4 = load(tiny_checkpoints["mlx-community-4bit"]).stt_model.lm_head
    assert isinstance(q4, nn.QuantizedLinear)
    assert not heads.should_split(q4)  # 400 rows
    monkeypatch.setattr(heads, "SPLIT_MIN_ROWS", 400)
    assert heads.should_split(q4)
    assert heads.should_split(_half_head())
    assert not heads.should_split(_head(400, 32))  # float32: column-major on the CPU
    assert step.head_stream() is step.head_stream()
    assert step.head_stream() != step.speech_stream()
