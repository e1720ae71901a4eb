"""The documented import paths of the package's first layout, kept working: each module here is
the module it names (one module object under both names), ``mlx_voicechat.runtime.session`` is
:mod:`mlx_voicechat.nemotron_voicechat.runtime.session`, and so on (docs/architecture.md)."""
