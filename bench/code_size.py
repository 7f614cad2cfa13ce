"""Code lines of the package and of bench/ at a git revision and now, group by group.

A code line is a line holding a Python token other than a comment or a docstring, so
reformatting docs or comments does not move the figure. A module in ``jaxckpt/_src/<folder>/``
belongs to the feature group <folder>, one directly in ``jaxckpt/_src/`` to "core", the public
modules ``jaxckpt/*.py`` to "facades". Older layouts are mapped onto that one: the flat
``_src/`` (before 7484b1e) by the old names of the feature modules (``MOVED``), and the
package before ``_src/`` existed (88e01f8) as if its modules sat in ``_src/``.

    python bench/code_size.py                 # now against c8984ad (before the folders)
    python bench/code_size.py --base HEAD~5 --head HEAD --group emergency --group bench
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The feature modules of the flat jaxckpt/_src/ (before 7484b1e): their folder/name since.
MOVED = {
    "emergency": "emergency/manager",
    "local": "emergency/local",
    "local_save": "emergency/save",
    "local_restore": "emergency/restore",
    "recovery": "emergency/recovery",
    "planner": "emergency/planner",
    "peers": "emergency/peers",
    "safetensors": "safetensors/load",
    "safetensors_save": "safetensors/save",
    "safetensors_map": "safetensors/mapping",
    "safetensors_format": "safetensors/format",
    "export": "export/save",
    "export_format": "export/format",
    "serving": "export/serving",
    "cli": "cli/main",
    "verify": "cli/verify",
    "convert": "cli/convert",
}
# Before jaxckpt/_src/ (88e01f8), the modules that stayed public files in jaxckpt/.
STAYED_PUBLIC = ("__init__", "errors")


def code_lines(source: str) -> int:
    """Lines with a token that is neither a comment nor part of a docstring."""
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstring_lines.update(range(value.lineno, value.end_lineno + 1))
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
        tokenize.ENCODING,
    }
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstring_lines)


def sources(rev: str | None, folder: str, recursive: bool) -> dict[str, str]:
    """{path: source} of the .py files under ``folder`` at ``rev`` (None: the working tree)."""
    if rev is None:
        return {
            p.relative_to(ROOT).as_posix(): p.read_text()
            for p in (ROOT / folder).glob("**/*.py" if recursive else "*.py")
        }

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    names = git("ls-tree", *["-r"] * recursive, "--name-only", rev, f"{folder}/").split()
    return {n: git("show", f"{rev}:{n}") for n in names if n.endswith(".py")}


def group_of(path: str, has_src: bool) -> tuple[str, str]:
    """(group, module) of a package file, in the folder layout whatever its revision's."""
    parts = path.removesuffix(".py").split("/")[1:]  # past "jaxckpt/"
    in_src = parts[0] == "_src"
    parts = parts[1:] if in_src else parts
    if len(parts) > 1:  # _src/<folder>/<module>
        return parts[0], parts[-1]
    name = parts[0]
    if not in_src and (has_src or name in STAYED_PUBLIC):
        return "facades", name
    return tuple(MOVED[name].split("/")) if name in MOVED else ("core", name)


def modules(rev: str | None) -> dict[tuple[str, str], int]:
    """{(group, module): code lines} of jaxckpt at ``rev`` (None: the working tree)."""
    files = sources(rev, "jaxckpt", recursive=True)
    has_src = any(p.startswith("jaxckpt/_src/") for p in files)
    out: dict[tuple[str, str], int] = {}
    for path, source in files.items():
        key = group_of(path, has_src)
        out[key] = out.get(key, 0) + code_lines(source)
    return out


def bench(rev: str | None) -> dict[tuple[str, str], int]:
    """{("bench", script): code lines} of bench/*.py at ``rev``."""
    return {("bench", Path(p).stem): code_lines(s) for p, s in sources(rev, "bench", False).items()}


def annotated(rev: str | None) -> tuple[int, int]:
    """(fully annotated functions, functions) of the package at ``rev``: every parameter
    but ``self``/``cls`` and the return annotated (mypy's disallow_untyped_defs rule)."""
    done = total = 0
    for source in sources(rev, "jaxckpt", recursive=True).values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                params = [x for x in params if x is not None][:None]
                if params and params[0].arg in ("self", "cls") and a.args[:1] == params[:1]:
                    params = params[1:]
                total += 1
                done += all(x.annotation is not None for x in params) and (
                    node.returns is not None or node.name == "__init__"
                )
    return done, total


def change(before: int, now: int) -> str:
    pct = f", {100 * (now - before) / before:+.1f}%" if before else ""
    return f"{before} -> {now} ({now - before:+d}{pct})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="c8984ad", help="git revision to compare against")
    ap.add_argument("--head", help="git revision to measure (default: the working tree)")
    ap.add_argument("--group", action="append", help="print this group only (repeatable)")
    args = ap.parse_args()
    before = modules(args.base) | bench(args.base)
    now = modules(args.head) | bench(args.head)
    folders = sorted({g for g, _ in before | now} - {"core", "facades", "bench"})
    groups = ["core", *folders, "facades", "bench"]
    unknown = set(args.group or ()) - set(groups)
    if unknown:
        ap.error(f"no group {', '.join(sorted(unknown))}; groups: {', '.join(groups)}")
    print(
        f"code lines (no blank, comment or docstring lines): {args.base} -> {args.head or 'working tree'}"
    )
    for group in args.group or groups:
        print(f"== {group}")
        for m in sorted({m for g, m in before | now if g == group}):
            b, n = before.get((group, m), 0), now.get((group, m), 0)
            if b or n:
                print(f"  {m:22s} {b:6d} {n:6d} {n - b:+6d}")
        b = sum(v for (g, _), v in before.items() if g == group)
        n = sum(v for (g, _), v in now.items() if g == group)
        print(f"  {'total':22s} {b:6d} {n:6d} {n - b:+6d}")
    for name, pick in (("package", lambda g: g != "bench"), ("bench", lambda g: g == "bench")):
        b = sum(v for (g, _), v in before.items() if pick(g))
        n = sum(v for (g, _), v in now.items() if pick(g))
        print(f"{name}: {change(b, n)}")
    for rev in (args.base, args.head):
        done, total = annotated(rev)
        print(
            f"annotated functions at {rev or 'working tree'}: {done}/{total} "
            f"({100 * done / total:.0f}%)"
        )


if __name__ == "__main__":
    main()
