"""NVIDIA NemotronLabs VoiceChat for MLX."""

import importlib

__version__ = "0.1.0"

__all__ = ["load", "Model", "VoiceChatConfig", "__version__"]
_LAZY = {"Model": ".nemotron_voicechat", "VoiceChatConfig": ".config"}  # name: its module


def load(path_or_hub_id, *, tokenizer=None, lazy: bool = False, revision=None):
    """Load a VoiceChat checkpoint (a local folder in any supported layout, or a Hugging Face
    hub id) as a :class:`mlx_voicechat.Model`; see
    :func:`mlx_voicechat.nemotron_voicechat.weights.loading.load`.
    A Nemotron-3.5-ASR checkpoint (either layout) loads as a
    :class:`mlx_voicechat.nemotron_asr.recognizer.Recognizer` (docs/asr.md)."""
    from .nemotron_asr.config import is_recognizer_config
    from .nemotron_voicechat import Model
    from .nemotron_voicechat.weights.loading import load as load_checkpoint
    from .nemotron_voicechat.weights.loading import read_config, resolve_path

    folder = resolve_path(path_or_hub_id, revision=revision)
    raw = read_config(folder)
    if is_recognizer_config(raw):
        from .nemotron_asr.loading import load_recognizer
        from .nemotron_asr.recognizer import Recognizer

        return load_recognizer(folder, raw, lazy=lazy, model_class=Recognizer)
    return load_checkpoint(folder, tokenizer=tokenizer, lazy=lazy, model_class=Model)


def __getattr__(name):
    # Keep `import mlx_voicechat` cheap: mlx is imported only when something is used.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'mlx_voicechat' has no attribute {name!r}")
