"""The package's boundary: the public names resolve, and no module reaches into another
module's underscore names (read from the source, so a new offence fails here)."""

import ast
import pathlib
import subprocess
import sys

import jaxckpt

PACKAGE = pathlib.Path(jaxckpt.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_public_names_resolve():
    for name in jaxckpt.__all__:
        assert getattr(jaxckpt, name) is not None, name
    assert jaxckpt.RecoveryReport.__module__.startswith("jaxckpt._src.")


def test_no_module_uses_another_modules_underscore_names():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()  # names bound to jaxckpt modules in this file
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                for alias in node.names:
                    if _private(alias.name):
                        offences.append(f"{path.name}: from {node.module} import {alias.name}")
                    if node.module is None or (PACKAGE / "_src" / node.module).is_dir():
                        modules.add(alias.asname or alias.name)  # from . import steps
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and _private(node.attr)
            ):
                offences.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offences, offences


FEATURES = ("emergency", "safetensors", "export", "cli")  # folders above the core
SERVICES = ("io", "goodput", "orbax")  # folders below it: the core calls them


def _imported_modules(package: tuple[str, ...], source: str) -> set[str]:
    """The jaxckpt modules (and names) a module of ``package`` imports, as dotted names;
    imports under ``if TYPE_CHECKING:`` (annotations only) are left out."""
    out = set()
    tree = ast.parse(source)
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - node.level + 1]
            mod = (*base, *(node.module.split(".") if node.module else ()))
            out.add(".".join(mod))
            out.update(".".join((*mod, a.name)) for a in node.names)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            out.update(n for n in names if n and n.startswith("jaxckpt"))
    return out


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("jaxckpt", *path.relative_to(PACKAGE).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports() -> dict[str, set[str]]:
    """The package's import graph: each module -> the package modules it imports."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        package = (
            tuple(name.split(".")) if path.name == "__init__.py" else tuple(name.split(".")[:-1])
        )
        graph[name] = {m for m in _imported_modules(package, path.read_text()) if m in mods} - {
            name
        }
    return graph


def _group(module: str) -> str:
    """ "core", a feature or a service folder, or "facade" (jaxckpt/*.py)."""
    parts = module.split(".")
    if parts[1:2] != ["_src"] or len(parts) == 2:
        return "facade"
    return parts[2] if len(parts) > 3 or parts[2] in (*FEATURES, *SERVICES) else "core"


def test_no_core_module_imports_a_feature():
    """The core (jaxckpt/_src/*.py) stands alone: the features (one folder each) build on it,
    never the other way round, so a feature can be read, changed or removed by itself; the
    services (``io/``, ``goodput/``, ``orbax/``) sit below it and import no feature either."""
    graph = _imports()
    assert sum(_group(m) == "core" for m in graph) > 15  # the test looks where the core is
    offences = [
        f"{m} imports {n}"
        for m, names in graph.items()
        if _group(m) == "core" or _group(m) in SERVICES
        for n in sorted(names)
        if _group(n) in FEATURES
    ]
    assert not offences, offences
    folders = {p.name for p in (PACKAGE / "_src").iterdir() if (p / "__init__.py").exists()}
    assert folders == set(FEATURES) | set(SERVICES)


def test_services_sit_below_the_core():
    """A service folder imports no core module that imports it back: following imports from
    a service never leads back into that service through the core (no cycles)."""
    graph = _imports()
    offences = []
    for service in SERVICES:
        for m in (m for m in graph if _group(m) == service):
            seen, todo = set(), [n for n in graph[m] if _group(n) != service]
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                for k in graph[n]:
                    if _group(k) == service:
                        offences.append(f"{m} -> {n} -> {k}")
                    else:
                        todo.append(k)
    assert not offences, sorted(set(offences))[:20]


def test_io_imports_no_jax():
    """Nothing under ``io/`` imports jax, however deep: each of its modules imports in a
    fresh interpreter where ``import jax`` fails (the package's own ``__init__``, which
    imports jax for the public API, is bypassed)."""
    code = f"""
import importlib, importlib.abc, sys, types
class NoJax(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jax" or name.startswith(("jax.", "jaxlib")):
            raise ImportError("io/ imported " + name)
sys.meta_path.insert(0, NoJax())
for name, where in (("jaxckpt", {str(PACKAGE)!r}), ("jaxckpt._src", {str(PACKAGE / "_src")!r})):
    stub = types.ModuleType(name)
    stub.__path__ = [where]
    sys.modules[name] = stub
import pathlib
for p in sorted(pathlib.Path({str(PACKAGE / "_src" / "io")!r}).glob("*.py")):
    importlib.import_module("jaxckpt._src.io" + ("" if p.stem == "__init__" else "." + p.stem))
assert "jax" not in sys.modules
print("ok", len(list(pathlib.Path({str(PACKAGE / "_src" / "io")!r}).glob("*.py"))))
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.startswith("ok ")


def test_the_boundary_check_resolves_relative_imports():
    src = "from .emergency import peers\nfrom . import safetensors\nfrom .. import errors\n"
    names = _imported_modules(("jaxckpt", "_src"), src)
    assert {"jaxckpt._src.emergency.peers", "jaxckpt._src.safetensors", "jaxckpt.errors"} <= names
    inner = _imported_modules(("jaxckpt", "_src", "cli"), "from ..emergency.local import X\n")
    assert "jaxckpt._src.emergency.local" in inner
