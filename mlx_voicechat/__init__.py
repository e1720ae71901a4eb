"""NVIDIA NemotronLabs VoiceChat for MLX."""

__version__ = "0.1.0"

__all__ = ["load", "Model", "VoiceChatConfig", "__version__"]


def __getattr__(name):
    # Keep `import mlx_voicechat` cheap: mlx is imported only when something is used.
    if name == "load":
        from .checkpoint import load

        return load
    if name == "Model":
        from .model import Model

        return Model
    if name == "VoiceChatConfig":
        from .config import VoiceChatConfig

        return VoiceChatConfig
    raise AttributeError(f"module 'mlx_voicechat' has no attribute {name!r}")
