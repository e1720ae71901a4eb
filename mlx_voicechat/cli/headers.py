"""What a checkpoint's safetensors headers say, for ``mlx-voicechat info`` on either kind of
checkpoint: each tensor's shape and dtype, the packed (quantized) modules, and the parameters
and dtypes per network (no tensor is read)."""

from __future__ import annotations


def tensor_headers(folder) -> dict:
    """``{key: (shape, dtype)}`` of every tensor in the folder's safetensors files, from their
    headers (no tensor is read)."""
    from safetensors import safe_open

    from ..errors import CheckpointError
    from ..nemotron_voicechat.weights.loading import weight_files

    shapes = {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    shapes[k] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    return shapes


def quantized_modules(shapes) -> set:
    """The modules whose weights are packed (they have ``.scales``)."""
    return {k[: -len(".scales")] for k in shapes if k.endswith(".scales")}


def network_report(shapes, quantized, bits_of, networks) -> dict:
    """``networks`` (parameters and dtypes of each network that has any, in ``networks``'
    order, then ``other``) and ``total_parameters``: a packed weight counts its unpacked values
    (``bits_of(module)`` bits each), its scales and biases count nothing."""
    counts = {name: 0 for name in networks}
    dtypes = {name: set() for name in networks}
    for k, (shape, dtype) in shapes.items():
        module = k.rsplit(".", 1)[0]
        if k.endswith((".scales", ".biases")) and module in quantized:
            continue
        n = 1
        for s in shape:
            n *= s
        if module in quantized and k.endswith(".weight"):
            bits = bits_of(module)
            n = n * 32 // bits
            dtype = f"{dtype}/{bits}-bit"
        net = next((name for name, prefixes in networks.items() if k.startswith(prefixes)), "other")
        counts[net] = counts.get(net, 0) + n
        dtypes.setdefault(net, set()).add(dtype)
    return {
        "networks": {
            name: {"parameters": n, "dtypes": sorted(dtypes[name])}
            for name, n in counts.items()
            if n
        },
        "total_parameters": sum(counts.values()),
    }
