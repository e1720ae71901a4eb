"""The package's families and their layers, read from the source: every import (those inside
functions too) points to the same or a lower (family, layer), and no module reaches itself
through its imports."""

import ast
from pathlib import Path

import pytest

PACKAGE = "mlx_voicechat"
SOURCE = Path(__file__).resolve().parents[1] / PACKAGE

# Families, lowest first, and each family's layers, lowest first: a module imports from its own
# (family, layer), an earlier layer of its family, or an earlier family. A family's names are
# relative to its folder (the shared family's are the package's own top-level names); a module
# belongs to the first entry that is its name or a package above it ("" is the family's
# package itself, "*" all of its folder).
FAMILIES = [
    (
        "",  # shared by both models
        [
            ("errors", "noise", "files", "threads", "derived", "caches"),  # errors; noise
            # sources; file-system helpers; MLX threads; values derived from weights; row caches
            ("config",),  # the dataclass tree every network is built from
            ("fastpaths",),  # the fast-path registry, the CPU layouts and BLAS
            ("audio",),  # audio I/O, the one log-mel and resampler, AudioIn, VAD, devices
            ("listen",),  # the one FastConformer, the RNNT and its one greedy decoder
        ],
    ),
    (
        "nemotron_voicechat",
        [("nets",), ("model",), ("weights",), ("runtime",), ("",)],  # "": mlx-lm's module
    ),
    (
        "nemotron_asr",
        [
            ("config_transformers", "config"),
            ("network",),
            ("layout", "loading", "factory"),
            ("transcribe", "session"),
            ("recognizer", ""),
        ],
    ),
    ("", [("",), ("factory", "runtime")]),  # the package (load()); the first layout's paths
    ("serve", [("*",)]),  # the Realtime protocol, the server, the web page
    ("cli", [("*",)]),  # one module per verb
    ("__main__", [("",)]),
]


def layer_of(module: str) -> tuple:
    """(family, layer) of a module, as indices into FAMILIES."""
    rel = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    for i, (folder, layers) in enumerate(FAMILIES):
        if folder and rel != folder and not rel.startswith(folder + "."):
            continue
        inner = rel[len(folder) + 1 :] if folder and rel != folder else ("" if folder else rel)
        for j, names in enumerate(layers):
            for name in names:
                if inner == name or name == "*" or (name and inner.startswith(name + ".")):
                    return (i, j)
    raise AssertionError(f"{module} is in no layer; add it to FAMILIES in {__file__}")


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
    family = f"{PACKAGE}.nemotron_voicechat"
    assert not {
        t
        for t in edges[f"{family}.model"]
        if t.startswith((f"{family}.weights", f"{family}.runtime"))
    }


def test_the_shared_families_reach_neither_model(edges):
    shared = [m for m in edges if layer_of(m)[0] == 0]
    assert f"{PACKAGE}.listen.greedy" in shared and f"{PACKAGE}.audio.mel" in shared
    assert not {
        (m, t)
        for m in shared
        for t in edges[m]
        if t.startswith((f"{PACKAGE}.nemotron_voicechat", f"{PACKAGE}.nemotron_asr"))
    }


def test_the_checker_sees_function_level_upward_imports_and_cycles(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "listen").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "listen" / "__init__.py").write_text("")
    a = "def f():\n    from ..nemotron_voicechat.runtime import duplex\n"
    (pkg / "listen" / "a.py").write_text(a)
    (pkg / "listen" / "b.py").write_text("from . import c\nfrom mlx_voicechat.errors import X\n")
    (pkg / "listen" / "c.py").write_text("import mlx_voicechat.listen.b\n")
    (pkg / "nemotron_voicechat" / "runtime").mkdir(parents=True)
    (pkg / "nemotron_voicechat" / "__init__.py").write_text("")
    (pkg / "nemotron_voicechat" / "runtime" / "__init__.py").write_text("")
    (pkg / "nemotron_voicechat" / "runtime" / "duplex.py").write_text("")
    (pkg / "nemotron_voicechat" / "runtime" / "up.py").write_text("from ... import load\n")
    g = graph(pkg)
    duplex = f"{PACKAGE}.nemotron_voicechat.runtime.duplex"
    assert g[f"{PACKAGE}.listen.a"] == {duplex}
    assert g[f"{PACKAGE}.listen.b"] == {f"{PACKAGE}.listen.c", f"{PACKAGE}.errors"}
    assert upward(g) == [
        f"{PACKAGE}.listen.a (layer (0, 4)) imports {duplex} (layer (1, 3))",
        f"{PACKAGE}.nemotron_voicechat.runtime.up (layer (1, 3)) imports {PACKAGE} (layer (3, 0))",
    ]
    assert cycle(g) == [f"{PACKAGE}.listen.b", f"{PACKAGE}.listen.c", f"{PACKAGE}.listen.b"]


def test_a_family_layer_is_found_by_family_then_layer():
    assert layer_of(f"{PACKAGE}.errors") == (0, 0)
    assert layer_of(f"{PACKAGE}.listen.rnnt") == (0, 4)
    assert layer_of(f"{PACKAGE}.nemotron_voicechat.nets.llm") == (1, 0)
    assert layer_of(f"{PACKAGE}.nemotron_voicechat") == (1, 4)
    assert layer_of(f"{PACKAGE}.nemotron_asr.session") == (2, 3)
    assert layer_of(f"{PACKAGE}.runtime.session") == (3, 1)
    assert layer_of(f"{PACKAGE}.serve.app") == (4, 0)
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of(f"{PACKAGE}.nemotron_voicechat.unplaced")


@pytest.mark.parametrize(
    "old, new",
    [
        ("runtime.session", "nemotron_voicechat.runtime.session"),
        ("runtime.request", "nemotron_voicechat.runtime.request"),
        ("runtime.devices", "audio.devices"),
        ("runtime.asr_session", "nemotron_asr.session"),
    ],
)
def test_the_first_layouts_documented_paths_are_the_modules(old, new):
    import importlib

    kept = importlib.import_module(f"{PACKAGE}.{old}")
    assert kept is importlib.import_module(f"{PACKAGE}.{new}")
    assert kept.__name__ == f"{PACKAGE}.{new}"


def test_the_factory_path_keeps_make_checkpoint():
    from mlx_voicechat.factory import make_checkpoint
    from mlx_voicechat.nemotron_voicechat.weights.factory import make_checkpoint as moved

    assert make_checkpoint is moved


def _names_imported_from_the_package(path: Path):
    """``(line, module, name)`` of every ``from mlx_voicechat... import name`` in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE or node.module.startswith(PACKAGE + "."):
                yield from ((node.lineno, node.module, a.name) for a in node.names)


def test_every_name_the_tests_import_from_the_package_exists():
    """Some test modules are skipped where their tools are missing (torch for the Transformers
    reference, which CI runs only after the suite; a browser; Ray): what they import from the
    package is checked here, where nothing is skipped, so a rename cannot hide in them."""
    import importlib

    tests = SOURCE.parent / "tests"
    missing = []
    for path in sorted(tests.rglob("*.py")):
        for line, module, name in _names_imported_from_the_package(path):
            try:
                found = importlib.import_module(module)
            except ModuleNotFoundError as e:  # an optional dependency this machine lacks
                if (e.name or "").split(".")[0] == PACKAGE:
                    raise
                continue
            if not hasattr(found, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{path.relative_to(tests)}:{line}: {module}.{name}")
    assert missing == []
