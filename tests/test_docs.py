"""The docs that describe the package keep up with it: docs/modules.png's script draws every
module, and every path docs/ARCHITECTURE.md names exists (and every module has its line).

Read from the source and the markdown alone: nothing here imports jaxckpt or draws, and the
module graph script is imported without matplotlib (it needs it only to draw)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxckpt"
SRC = PACKAGE / "_src"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
SCRIPT = ROOT / "docs" / "module_graph.py"


def _script():
    spec = importlib.util.spec_from_file_location("module_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def _modules() -> set[pathlib.Path]:
    """Every module file of the package, but the ``__init__.py`` of ``_src/`` and of its
    folders (a folder is drawn and described as its modules)."""
    return {
        p
        for p in PACKAGE.rglob("*.py")
        if not (p.name == "__init__.py" and SRC in (p.parent, *p.parent.parents))
    }


def test_the_module_graph_draws_every_module():
    drawn = _script().drawn_files(ROOT)
    assert sorted(drawn.values()) == sorted(_modules()), (
        "docs/module_graph.py draws other modules than the package has: a new folder under "
        "jaxckpt/_src/ goes into its FEATURES or SERVICES, and docs/modules.png is redrawn"
    )
    assert len(set(drawn.values())) == len(drawn)  # one box a module


def test_the_module_graph_lists_modules_without_matplotlib():
    code = (
        "import runpy, sys\n"
        f"g = runpy.run_path({str(SCRIPT)!r})\n"
        "g['build_graph']()\n"
        "assert not [m for m in sys.modules if m.startswith(('matplotlib', 'PIL', 'jax'))]\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-2000:]


def _named_paths(text: str) -> list[tuple[str, bool]]:
    """Each path in backquotes that ends in ``.py`` or ``/`` (``io/slices.py``,
    ``emergency/``), with whether the page says it is still to come (``(coming)``)."""
    return [
        (m.group(1), m.group(2) is not None)
        for m in re.finditer(r"`([\w./-]+(?:\.py|/))`( \(coming\))?", text)
    ]


def _resolves(name: str) -> bool:
    """A path as this page writes it: from the repository root, from ``jaxckpt/``, or from
    ``jaxckpt/_src/`` (the core's and the folders' modules)."""
    return any((base / name).exists() for base in (ROOT, PACKAGE, SRC))


def test_every_path_architecture_names_exists():
    text = ARCHITECTURE.read_text()
    named = _named_paths(text)
    assert len(named) > 60  # the test looks where the paths are
    missing = [name for name, coming in named if not coming and not _resolves(name)]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"
    links = re.findall(r"\]\((?!https?:)([^)#]+)\)", text)
    broken = [link for link in links if not (ARCHITECTURE.parent / link).exists()]
    assert not broken, f"docs/ARCHITECTURE.md links to files that do not exist: {broken}"


def test_architecture_has_a_line_for_every_module():
    named = {name for name, _ in _named_paths(ARCHITECTURE.read_text())}
    unnamed = [
        str(p.relative_to(ROOT))
        for p in sorted(_modules())
        if str(p.relative_to(SRC if SRC in p.parents else ROOT)) not in named
    ]
    assert not unnamed, f"docs/ARCHITECTURE.md has no line for {unnamed}"


def test_the_path_reader_sees_coming_modules():
    found = _named_paths("| `io/linux.py` (coming) | x |\n`saving.py`, `emergency/` and `a b.py`")
    assert found == [("io/linux.py", True), ("saving.py", False), ("emergency/", False)]
