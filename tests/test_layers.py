"""The package's layers, read from the source: every import (those inside functions too) points
to the same or a lower layer, and no module reaches itself through its imports."""

import ast
from pathlib import Path

import pytest

PACKAGE = "mlx_voicechat"
SOURCE = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A module belongs to the first entry that is its name or a package above it.
LAYERS = [
    ("errors", "noise", "files"),  # one-line errors; noise sources; file-system helpers
    ("config",),  # the dataclass tree every network is built from
    ("nets.mel", "nets"),  # the log-mel front-end and resampler; perception, rnnt, llm, tts,
    # char_encoder, codec (and their weight layout)
    ("model",),  # the parameter tree of the whole model
    ("weights", "factory"),  # sanitize, loading, writing, convert, the random-weight factory
    ("runtime",),  # audio I/O, the per-frame step, offline generate, transcribe, sessions
    ("nemotron_voicechat", "recognizer", ""),  # the entry points: mlx-lm / mlx-audio's module,
    # the user-facing Nemotron-3.5-ASR recognizer, the package
    ("serve",),  # the Realtime protocol, the server, the web page
    ("cli",),  # one module per verb
    ("__main__",),
]


def layer_of(module: str) -> int:
    rel = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    for i, names in enumerate(LAYERS):
        for name in names:
            if rel == name or (name and rel.startswith(name + ".")):
                return i
    raise AssertionError(f"{module} is in no layer; add it to LAYERS in {__file__}")


def modules(root: Path, package: str = PACKAGE) -> dict:
    """{module name: (file, is package)} for every .py file below ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join([package, *parts])] = (path, is_package)
    return out


def imports(module: str, path: Path, is_package: bool, known) -> set:
    """The package's modules that ``module`` imports anywhere in its source."""
    found = set()
    here = module if is_package else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from X import name`: the submodule X.name where there is one, else X itself.
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            names = subs if len(subs) == len(node.names) else [target, *subs]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                while name not in known:  # `import a.b.c` names attribute paths too
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    found.add(name)
    return found


def graph(root: Path, package: str = PACKAGE) -> dict:
    known = modules(root, package)
    return {m: imports(m, path, pkg, known) for m, (path, pkg) in known.items()}


def upward(edges: dict, layer=layer_of) -> list:
    return sorted(
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in edges.items()
        for t in targets
        if layer(t) > layer(m)
    )


def cycle(edges: dict):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                return path[path.index(t) :] + [t]
            if t not in state:
                found = visit(t, path + [t])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


@pytest.fixture(scope="module")
def edges():
    return graph(SOURCE)


def test_every_module_has_a_layer(edges):
    assert len(edges) > 25
    for m in edges:
        layer_of(m)


def test_no_module_imports_a_higher_layer(edges):
    assert upward(edges) == []


def test_no_import_cycle(edges):
    assert cycle(edges) is None


def test_model_reaches_neither_weights_nor_runtime(edges):
    assert not {
        t
        for t in edges[f"{PACKAGE}.model"]
        if t.startswith((f"{PACKAGE}.weights", f"{PACKAGE}.runtime"))
    }


def test_the_checker_sees_function_level_upward_imports_and_cycles(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "nets").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "nets" / "__init__.py").write_text("")
    (pkg / "nets" / "a.py").write_text("def f():\n    from ..runtime import duplex\n")
    (pkg / "nets" / "b.py").write_text("from . import c\nfrom mlx_voicechat.errors import X\n")
    (pkg / "nets" / "c.py").write_text("import mlx_voicechat.nets.b\n")
    (pkg / "runtime").mkdir()
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "duplex.py").write_text("")
    g = graph(pkg)
    assert g[f"{PACKAGE}.nets.a"] == {f"{PACKAGE}.runtime.duplex"}
    assert g[f"{PACKAGE}.nets.b"] == {f"{PACKAGE}.nets.c", f"{PACKAGE}.errors"}
    assert upward(g) == [f"{PACKAGE}.nets.a (layer 2) imports {PACKAGE}.runtime.duplex (layer 5)"]
    assert cycle(g) == [f"{PACKAGE}.nets.b", f"{PACKAGE}.nets.c", f"{PACKAGE}.nets.b"]
