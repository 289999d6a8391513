"""The layers of DESIGN.md hold in the code: arrows point down only, no import loops,
nothing inside the package imports its face, no private name crosses a module, no
library file past ~450 lines.

The table below is the one place the layers are written down for the code; a new
package must be added to it (the test fails on a module it does not know).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.unit

PKG = pathlib.Path(__file__).resolve().parents[2] / "phalanx"
MAX_LINES = 450

# Lowest first. A module may import its own layer or a lower one, never a higher one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("phalanx.log", "phalanx.trace", "phalanx.settings", "phalanx.version", "phalanx.models")),
    ("runtime", ("phalanx.runtime",)),
    ("comm", ("phalanx.comm",)),
    ("strategies", ("phalanx.parallel", "phalanx.ps", "phalanx.optim")),
    ("services", ("phalanx.checkpoint", "phalanx.elastic", "phalanx.balance", "phalanx.profiler",
                  "phalanx.planner", "phalanx.memory", "phalanx.preemption")),
    ("launch", ("phalanx.launcher",)),
    # phalanx.launcher._spare: a process entry point run by path (the warm spare), whose whole job is to
    # import what a user's script imports, the face included, before it becomes that script
    ("fronts", ("phalanx", "phalanx.__main__", "phalanx.launcher._spare", "phalanx.trainer", "phalanx.horovod", "phalanx.keras",
                "phalanx.tensorflow", "phalanx.ray", "phalanx.tune", "phalanx.testing", "phalanx.cli",
                "phalanx.demo")),
]


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix that names ``module``."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # the face `phalanx` names itself only; every other entry names a module and what is below it
            within = module == prefix or (prefix != "phalanx" and module.startswith(prefix + "."))
            if within and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for every phalanx import, lazy ones included."""
    path = MODULES[module]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:      # `from pkg import submodule`
                    out.append((node.lineno, f"{base}.{alias.name}", None))
                else:
                    out.append((node.lineno, base, alias.name))
    return [(line, target, name) for line, target, name in out if target.split(".")[0] == "phalanx"]


def test_every_module_has_a_layer():
    unknown = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unknown, f"add these modules to LAYERS in {__file__}: {unknown}"


def test_arrows_point_down():
    bad = []
    for module in sorted(MODULES):
        own = layer_of(module)
        for line, target, _ in _imports(module):
            theirs = layer_of(target)
            if own is not None and theirs is not None and theirs > own:
                bad.append(f"{module}:{line} ({LAYERS[own][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_nothing_inside_imports_the_face():
    bad = [f"{module}:{line} imports the package face `phalanx`{'.' + name if name else ''}"
           for module in sorted(MODULES) if module not in ("phalanx", "phalanx.__main__", "phalanx.launcher._spare")
           for line, target, name in _imports(module) if target == "phalanx"]
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_module():
    bad = [f"{module}:{line} imports {name} from {target}"
           for module in sorted(MODULES)
           for line, target, name in _imports(module)
           if name and name.startswith("_") and not name.startswith("__") and target != module]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_no_import_loop():
    graph = {m: {t for _, t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []

    def visit(v: str) -> None:                      # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not loops, "import loops (lazy imports count):\n" + "\n".join(" <-> ".join(c) for c in loops)


def test_no_file_past_the_size_limit():
    big = [f"{MODULES[m].relative_to(PKG.parent)} has {n} lines" for m in sorted(MODULES)
           if (n := len(MODULES[m].read_text().splitlines())) > MAX_LINES]
    assert not big, f"split these along a seam (limit {MAX_LINES}):\n" + "\n".join(big)


def test_the_layer_table_orders_the_floors():
    """A strategy sits below a service, the launcher machinery below the CLI front."""
    assert layer_of("phalanx.parallel.x") < layer_of("phalanx.checkpoint.y")
    assert layer_of("phalanx.launcher.cli") == [n for n, _ in LAYERS].index("launch")
    assert layer_of("phalanx.cli.run") == [n for n, _ in LAYERS].index("fronts")
    assert layer_of("phalanx.somewhere_new") is None       # a new package must be placed by hand


def _only_reexports(path: pathlib.Path) -> bool:
    """A module whose body is a docstring, imports, ``__all__`` and nothing else."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [n for n in body if not isinstance(n, (ast.Import, ast.ImportFrom))
            and not (isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])]
    return bool(imports) and not rest


# Modules that re-export on purpose: another library's import path, kept so its scripts run with
# only the import line changed.
API_PATHS = {"phalanx.horovod.ray": "horovod.ray"}


def test_no_module_only_re_exports():
    """A module that only re-exports another's names is an old home kept for imports: delete it and
    import the real one (a package's ``__init__`` is its face, and may)."""
    offenders = sorted(m for m, path in MODULES.items()
                       if path.name != "__init__.py" and m not in API_PATHS and _only_reexports(path))
    assert not offenders, f"these modules only re-export; import their real homes and delete them: {offenders}"
