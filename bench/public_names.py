"""Every public name of jaxckpt, one a line, and their total: the surface frozen at 0.1.0.

A public name is a dotted path a user reaches as documented, with no underscore part:

* ``jaxckpt.X`` for each ``X`` in ``jaxckpt.__all__`` (a public submodule counts once, as
  its own name), and ``jaxckpt.__version__``;
* ``jaxckpt.M.X`` for each public submodule ``M`` (a module listed in ``jaxckpt.__all__``:
  ``errors``, ``export``, ``safetensors``) and each ``X`` in ``M.__all__``, or, where ``M``
  has none, each name not starting with ``_`` that ``M`` itself defines (not one it
  imports).

A class or function reached by two paths (a re-export) counts once per path: each is a
name users can write and that must stay. Attributes of public classes (methods, option
fields) are not counted. ``jaxckpt._src`` is private: tests may import from it, users may
not rely on it.

    python bench/public_names.py           # the names by module, then the total
    python bench/public_names.py --total   # the total only
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's
import jaxckpt  # noqa: E402


def _module_names(module: types.ModuleType) -> list[str]:
    listed = getattr(module, "__all__", None)
    if listed is not None:
        return sorted(listed)
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", module.__name__) == module.__name__
    )


def public_names() -> dict[str, list[str]]:
    """The public dotted names, by the module a user reaches them through."""
    top = sorted({*jaxckpt.__all__, "__version__"})
    out = {"jaxckpt": [f"jaxckpt.{n}" for n in top]}
    for name in top:
        value = getattr(jaxckpt, name)
        if isinstance(value, types.ModuleType):
            out[f"jaxckpt.{name}"] = [f"jaxckpt.{name}.{n}" for n in _module_names(value)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", action="store_true", help="print the total only")
    args = parser.parse_args()
    groups = public_names()
    if not args.total:
        for module, names in groups.items():
            print(f"{module} ({len(names)}):")
            for name in names:
                print(f"  {name}")
    print(f"total: {sum(len(n) for n in groups.values())}")


if __name__ == "__main__":
    main()
