"""Code lines of the package at a git revision and now, module by module.

A code line is a line holding a Python token other than a comment or a docstring, so
reformatting docs or comments does not move the figure. Modules are matched by name whether
they sit in ``jaxckpt/`` (older layouts) or ``jaxckpt/_src/``.

    python bench/code_size.py                 # now against 7897e92 (issue 12 filed)
    python bench/code_size.py --base HEAD~5 --group emergency
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Modules by the behaviour they hold; a module split in two stays in its group.
GROUPS = {
    "emergency": [
        "emergency",
        "local",
        "local_save",
        "local_restore",
        "recovery",
        "planner",
        "peers",
    ],
    "core": [
        "checkpoint",
        "restoring",
        "manifest",
        "arrays",
        "sharding",
        "tree",
        "storage",
        "steps",
        "placement",
        "staging",
        "writer",
        "multihost",
        "options",
        "errors",
        "__init__",
    ],
    "manager": ["manager"],
    "export": ["export", "export_format", "serving"],
}


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


def modules(rev: str | None) -> dict[str, int]:
    """{module name: code lines} of jaxckpt at ``rev`` (None: the working tree)."""
    if rev is None:
        files = {
            p.relative_to(ROOT).as_posix(): p.read_text() for p in ROOT.glob("jaxckpt/**/*.py")
        }
    else:
        names = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, "jaxckpt/"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        files = {
            n: subprocess.run(
                ["git", "show", f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True, text=True
            ).stdout
            for n in names.split()
            if n.endswith(".py")
        }
    out: dict[str, int] = {}
    for path, source in files.items():
        parts = path.split("/")
        # Public facades (jaxckpt/x.py over jaxckpt/_src/x.py) count as "x.facade".
        name = parts[-1][:-3] if "_src" in parts or len(parts) == 2 else path
        if (
            "_src" not in parts
            and len(parts) == 2
            and any(p.endswith(f"_src/{parts[-1]}") for p in files)
        ):
            name += ".facade"
        out[name] = out.get(name, 0) + code_lines(source)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="7897e92", help="git revision to compare against")
    ap.add_argument("--head", help="git revision to measure (default: the working tree)")
    ap.add_argument("--group", choices=[*GROUPS, "facades", "others"], help="print one group only")
    args = ap.parse_args()
    before, now = modules(args.base), modules(args.head)
    named = {m for ms in GROUPS.values() for m in ms}
    groups = dict(GROUPS)
    groups["facades"] = sorted(n for n in before.keys() | now.keys() if n.endswith(".facade"))
    groups["others"] = sorted(  # against 7897e92: the modules of features added since
        n for n in before.keys() | now.keys() if n not in named and not n.endswith(".facade")
    )
    shown = [args.group] if args.group else list(groups)
    print(
        f"code lines (no blank, comment or docstring lines): {args.base} -> {args.head or 'working tree'}"
    )
    for group in shown:
        print(f"== {group}")
        for m in groups[group]:
            b, n = before.get(m, 0), now.get(m, 0)
            if b or n:
                print(f"  {m:22s} {b:6d} {n:6d} {n - b:+6d}")
        b = sum(before.get(m, 0) for m in groups[group])
        n = sum(now.get(m, 0) for m in groups[group])
        print(f"  {'total':22s} {b:6d} {n:6d} {n - b:+6d}")
    print(
        f"package: {sum(before.values())} -> {sum(now.values())} "
        f"({sum(now.values()) - sum(before.values()):+d})"
    )


if __name__ == "__main__":
    main()
