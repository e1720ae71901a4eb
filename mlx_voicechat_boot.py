"""Start-up hook of mlx-voicechat (imported by ``mlx_voicechat.pth`` at interpreter start).

mlx-lm and mlx-audio import model code by name (``mlx_lm.models.<type>``,
``mlx_audio.<kind>.models.<type>``) and read no entry points: a lazy ``sys.meta_path`` finder
answers those names from the entry point groups of the same names (read on first lookup; mlx is
never imported here). ``MLX_VOICECHAT_DISABLE=1`` installs nothing; ``MLX_VOICECHAT_OVERRIDE=0``
lets a built-in module of the same name win.

``mlx_lm.utils`` gets two thin wrappers: ``load_config`` refuses NVIDIA's raw release with one
clear line (not a bare ``KeyError``), ``load_model`` runs ``Model.post_load_hook`` so the model
gets its tokenizer. ``MLX_VOICECHAT_BLAS=openblas`` (or a library path) loads that BLAS globally
before mlx is first imported (Linux only); ``mlx-voicechat info --system`` says which is in use.
"""

import os
import sys

_TRUE_OFF = ("0", "false", "no", "off")
BLAS_ENV = "MLX_VOICECHAT_BLAS"
#: What the hook did about MLX_VOICECHAT_BLAS: None (not asked), the library it loaded, or
#: ("not loaded", why).
BLAS = None


def _warn(message):
    sys.stderr.write("mlx-voicechat: " + message + "\n")


def openblas_candidates():
    """Where Debian / Ubuntu put OpenBLAS (the pthread build first), then the linker's search."""
    arch = os.uname().machine + "-linux-gnu"
    roots = ["/usr/lib/" + arch, "/usr/lib64", "/usr/lib"]
    out = []
    for root in roots:
        for sub in ("openblas-pthread/", "openblas-openmp/", "openblas-serial/", ""):
            out.append(root + "/" + sub + "libopenblas.so.0")
    return out + ["libopenblas.so.0"]


def load_blas():
    """Honour MLX_VOICECHAT_BLAS (see the module docstring); returns what :data:`BLAS` says."""
    global BLAS
    want = os.environ.get(BLAS_ENV, "").strip()
    if not want:
        return BLAS
    if not sys.platform.startswith("linux"):
        BLAS = ("not loaded", "only MLX's Linux CPU backend uses a BLAS library of its own")
        _warn("%s=%s has no effect here: %s" % (BLAS_ENV, want, BLAS[1]))
        return BLAS
    if "mlx.core" in sys.modules:
        BLAS = ("not loaded", "mlx was imported before mlx-voicechat's start-up hook")
        _warn("%s=%s has no effect: %s (the wheel's BLAS stays in effect)" % (BLAS_ENV, want, BLAS[1]))
        return BLAS
    import ctypes

    paths = openblas_candidates() if want.lower() == "openblas" else [want]
    errors = []
    for path in paths:
        if "/" in path and not os.path.exists(path):
            continue
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            errors.append(str(e))
            continue
        BLAS = path
        return BLAS
    why = errors[-1] if errors else "not found in " + ", ".join(p for p in paths if "/" in p)
    BLAS = ("not loaded", why)
    hint = " (Debian / Ubuntu: apt-get install libopenblas0-pthread)" if want.lower() == "openblas" else ""
    _warn("%s=%s: cannot load it: %s; the wheel's BLAS stays in effect%s" % (BLAS_ENV, want, why, hint))
    return BLAS


def _exists(name):
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _group_and_rest(fullname):
    """('mlx_lm.models', 'type', [sub...]) for names the finder serves, else None."""
    parts = fullname.split(".")
    if parts[0] == "mlx_lm" and len(parts) >= 3 and parts[1] == "models":
        return "mlx_lm.models", parts[2], parts[3:]
    if parts[0] == "mlx_audio" and len(parts) >= 4 and parts[2] == "models":
        return "mlx_audio.%s.models" % parts[1], parts[3], parts[4:]
    return None


class _AliasLoader:
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        import importlib

        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias spec on the shared module; give it back its own.
        module.__spec__ = self._spec


class _PatchingLoader:
    """A module's own loader, with ``patch(module)`` run after the module has executed."""

    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _is_nvidia_voicechat(config):
    model = config.get("model") if isinstance(config, dict) else None
    return (
        "model_type" not in config
        and isinstance(model, dict)
        and "stt" in model
        and "speech_generation" in model
    )


def _patch_mlx_lm_utils(utils):
    load_config, load_model = utils.load_config, utils.load_model

    def voicechat_load_config(model_path, *args, **kwargs):
        config = load_config(model_path, *args, **kwargs)
        if _is_nvidia_voicechat(config):
            raise ValueError(
                f"{model_path} is NVIDIA's raw NemotronLabs VoiceChat release (a NeMo config "
                "without model_type), which mlx_lm.load cannot read: use "
                "mlx_voicechat.load(path, tokenizer=...), or convert it first with "
                f"`mlx-voicechat convert --source {model_path} --output <folder> --tokenizer "
                "nvidia/NVIDIA-Nemotron-Nano-9B-v2`"
            )
        return config

    def voicechat_load_model(model_path, *args, **kwargs):
        model, config = load_model(model_path, *args, **kwargs)
        if type(model).__module__.startswith("mlx_voicechat"):
            model.post_load_hook(model, model_path)
        return model, config

    voicechat_load_config.__wrapped__ = load_config
    voicechat_load_model.__wrapped__ = load_model
    voicechat_load_model.__doc__ = load_model.__doc__
    voicechat_load_config.__doc__ = load_config.__doc__
    utils.load_config, utils.load_model = voicechat_load_config, voicechat_load_model


_PATCHES = {"mlx_lm.utils": _patch_mlx_lm_utils}


class PluginFinder:
    """Resolves ``mlx_lm.models.X`` / ``mlx_audio.K.models.X`` to entry-point modules."""

    def __init__(self):
        self._groups = None

    def _entries(self, group):
        if self._groups is None:
            from importlib.metadata import distributions

            groups = {}
            found = (ep for dist in distributions() for ep in dist.entry_points)
            for ep in found:
                if ep.group == "mlx_lm.models" or (
                    ep.group.startswith("mlx_audio.") and ep.group.endswith(".models")
                ):
                    groups.setdefault(ep.group, {})[ep.name] = ep.value.split(":")[0]
            self._groups = groups
        return self._groups.get(group, {})

    def _builtin_exists(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                if finder.find_spec(fullname, path, target) is not None:
                    return True
            except Exception:
                continue
        return False

    def _patched_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, _PATCHES[fullname])
                return spec
        return None

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _PATCHES:
            return self._patched_spec(fullname, path, target)
        found = _group_and_rest(fullname)
        if found is None:
            return None
        group, model_type, sub = found
        module = self._entries(group).get(model_type)
        if module is None:
            return None
        if not sub and os.environ.get("MLX_VOICECHAT_OVERRIDE", "1").lower() in _TRUE_OFF:
            if self._builtin_exists(fullname, path, target):
                return None
        if sub:
            # `<alias>.model` is the entry package's `model` (`mlx_voicechat.nemotron_voicechat
            # .model`), `<alias>.config` the plugin package's `config` where the entry package
            # has none; `<alias>.config.tree` is that package's `tree`: one module object under
            # both names, never a second copy.
            parent = sys.modules.get(fullname.rsplit(".", 1)[0])
            package = module.rsplit(".", 1)[0]
            if parent is None:
                return None
            if parent.__name__ == module:  # the entry package's own submodule, else a shared one
                own = module + "." + sub[-1]
                module = own if _exists(own) else package + "." + sub[-1]
            elif len(sub) > 1 and parent.__name__.startswith(package + "."):
                module = parent.__name__ + "." + sub[-1]
            else:
                return None  # the parent is the built-in package, not ours
        from importlib.machinery import ModuleSpec

        return ModuleSpec(fullname, _AliasLoader(module))

    def invalidate_caches(self):
        self._groups = None


def install():
    if os.environ.get("MLX_VOICECHAT_DISABLE", "0").lower() not in _TRUE_OFF:
        return None
    for finder in sys.meta_path:
        if isinstance(finder, PluginFinder) or type(finder).__name__ == "PluginFinder":
            return finder
    finder = PluginFinder()
    sys.meta_path.insert(0, finder)
    return finder


install()
load_blas()
