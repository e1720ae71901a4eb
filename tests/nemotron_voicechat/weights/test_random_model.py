"""The in-memory random-weight model equals the factory's checkpoint loaded from disk."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_voicechat import load
from mlx_voicechat.errors import VoiceChatError
from mlx_voicechat.factory import make_checkpoint
from mlx_voicechat.nemotron_voicechat import Model
from mlx_voicechat.nemotron_voicechat.weights.random_model import random_model


@pytest.mark.parametrize(
    "options", [{}, {"quantize": 4, "dtype": "bfloat16"}], ids=["float32", "4bit-bf16"]
)
def test_same_model_as_the_factory_checkpoint(tmp_path, options):
    disk = load(make_checkpoint(tmp_path / "c", "tiny", "mlx-community", seed=3, **options))
    mem = random_model("tiny", seed=3, model_class=Model, **options)
    a, b = dict(tree_flatten(disk.parameters())), dict(tree_flatten(mem.parameters()))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert mx.array_equal(a[k], b[k]).item(), k
    da, db = disk.config.to_dict(), mem.config.to_dict()
    da.pop("model_path", None), db.pop("model_path", None)
    assert da == db
    assert mem.config.quantization == disk.config.quantization
    assert mem.rnnt_vocabulary == disk.rnnt_vocabulary
    text = "What is the capital of France?"
    assert mem.tokenizer.encode(text) == disk.tokenizer.encode(text)
    assert mem.tokenizer.eos_token == disk.tokenizer.eos_token == "</s>"
    # The same frames: ids and codes of a short session are equal.
    samples = (0.1 * np.random.default_rng(0).standard_normal(1280 * 4)).astype(np.float32)
    ea = disk.session("Hi", seed=0).feed(samples)
    eb = mem.session("Hi", seed=0).feed(samples)
    assert [(e.text_id, e.function_id) for e in ea] == [(e.text_id, e.function_id) for e in eb]
    assert all(np.array_equal(x.audio, y.audio) for x, y in zip(ea, eb, strict=True))


def test_the_factory_filterbank_is_nemos_bits():
    """The factory's mel filterbank is the one NeMo (librosa) stores, bit for bit."""
    from oracle_utils import ORACLE

    key = "perception.preprocessor.featurizer.fb"
    nemo = mx.load(str(ORACLE / "01_perception_rnnt.safetensors"))[key]
    ours = dict(tree_flatten(random_model("tiny", seed=0).parameters()))["stt_model." + key]
    assert ours.shape == nemo.shape == (1, 128, 257)
    assert mx.array_equal(ours, nemo).item()


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(VoiceChatError, match="quantize must be 4 or 8"):
        random_model("tiny", quantize=3)
    with pytest.raises(VoiceChatError, match="unknown scale"):
        random_model("huge")
