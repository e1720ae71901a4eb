"""What the process runs on: MLX's version and devices, and which BLAS MLX's CPU backend uses
(read from the process's own mappings and symbol table, not assumed)."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from typing import Dict, List, Optional


def _mapped_blas() -> List[str]:
    """The BLAS-like shared libraries mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        path = line.split()[-1] if line.split() else ""
        name = os.path.basename(path)
        if path.startswith("/") and ("blas" in name or "mkl" in name) and path not in out:
            out.append(path)
    return out


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_sgemm() -> Optional[str]:
    """The library whose ``cblas_sgemm`` the global symbol scope resolves to, if any: a BLAS
    loaded globally before MLX (``MLX_VOICECHAT_BLAS``) is the one MLX's calls reach."""
    try:
        libc = ctypes.CDLL(None)
        addr = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value
        info = _DlInfo()
        if ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info.dli_fname:
            return os.fsdecode(info.dli_fname)
    except (AttributeError, OSError, ValueError):
        pass
    return None


def blas_in_effect() -> Dict[str, Optional[str]]:
    """Which BLAS MLX's CPU matrix products use in this process, and why."""
    boot = sys.modules.get("mlx_voicechat_boot")
    loaded = getattr(boot, "BLAS", None)
    requested = os.environ.get("MLX_VOICECHAT_BLAS", "").strip() or None
    if sys.platform == "darwin":
        return {"blas": "Accelerate (MLX on macOS)", "library": None, "requested": requested}
    mapped = _mapped_blas()
    glob = _global_sgemm()
    wheel = next((p for p in mapped if "mlx_cpu.libs" in p or "/mlx/" in p), None)
    if glob is not None:
        openblas = "openblas" in os.path.basename(glob).lower()
        blas, library = "OpenBLAS" if openblas else "a BLAS loaded globally", glob
        if loaded == glob:
            blas += " (loaded by MLX_VOICECHAT_BLAS)"
    elif wheel is not None:
        blas, library = "the mlx[cpu] wheel's own reference BLAS", wheel
    else:
        blas, library = "unknown (MLX's CPU backend not loaded)", None
    return {"blas": blas, "library": library, "requested": requested, "mapped": mapped}


def system_info() -> Dict[str, object]:
    import mlx.core as mx

    info: Dict[str, object] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "mlx": getattr(mx, "__version__", "?"),
        "default_device": str(mx.default_device()),
        "metal": bool(getattr(mx, "metal", None) and mx.metal.is_available()),
        "cuda": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
    }
    blas = blas_in_effect()
    info["blas"] = blas.pop("blas")
    info.update({"blas_" + k: v for k, v in blas.items()})
    return info
