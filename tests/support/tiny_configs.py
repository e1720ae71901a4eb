"""Tiny configurations more than one test folder builds networks from."""

from mlx_voicechat.config import EncoderConfig

#: A two-layer FastConformer on 16 mel bins (perception's and the encoder step's tests).
TINY_ENCODER = EncoderConfig(
    feat_in=16,
    n_layers=2,
    d_model=32,
    n_heads=2,
    subsampling_conv_channels=8,
    conv_kernel_size=5,
    att_context_size=(6, 0),
)
