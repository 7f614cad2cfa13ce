"""The package's boundary: the public names resolve, and no module reaches into another
module's underscore names (read from the source, so a new offence fails here)."""

import ast
import pathlib

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
                    if node.module in (None, "_src", "."):  # from . import steps
                        modules.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and _private(node.attr)
            ):
                offences.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offences, offences
