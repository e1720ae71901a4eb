"""Checkpoints on disk: ``sanitize`` (NeMo / PyTorch layouts to ours), ``loading`` (any
supported layout, strict), ``writer`` (configs and safetensors shards), ``convert`` (to the
mlx-community layout) and the random-weight ``factory`` (with ``scales`` and ``random_init``).
Above :mod:`mlx_voicechat.nemotron_voicechat.model`, which it builds and fills."""
