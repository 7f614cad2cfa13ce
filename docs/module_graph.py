"""Draw jaxckpt's module import graph, layer by layer, as a PNG (docs/modules.png).

Imports are read with ``ast`` from the source (relative ones resolved, those inside functions
and under ``TYPE_CHECKING`` included); only edges between jaxckpt modules are kept. The
picture has four bands, top to bottom: the public facades, the features of ``jaxckpt/_src/``
(one block a folder: emergency, cli, safetensors, export), the core (``jaxckpt/_src/*.py``)
and the services the core calls (one block a folder: io, goodput, orbax). Inside the core and
each block, modules sit in rows by import depth (row 0: modules that import nothing of
their group). ``jaxckpt/errors.py`` is a facade that every layer imports, so it is drawn
under everything, as the floor. An import of a folder's ``__init__`` that re-exports names
(``from ._src.goodput import goodput``) is drawn to the modules it re-exports from. A
summary (modules per group, edges, edges from the core or a service into a feature, which
must be 0) is printed too.

    python docs/module_graph.py                   # writes docs/modules.png
    python docs/module_graph.py --out /tmp/modules.png
    python docs/module_graph.py --list            # the drawn modules, one a line; no drawing

Only ``draw`` needs matplotlib (and Pillow, which comes with it): the rest imports nothing
outside the standard library, so ``tests/test_docs.py`` reads the module list without them.
"""

from __future__ import annotations

import argparse
import ast
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.patches import FancyBboxPatch

ROOT = Path(__file__).resolve().parent.parent
PKG = "jaxckpt"
FEATURES = ("emergency", "cli", "safetensors", "export")  # above the core, left to right
SERVICES = ("io", "goodput", "orbax")  # below the core (the core calls them), left to right
FOLDERS = (*FEATURES, *SERVICES)
GROUPS = ("facades", *FEATURES, "core", *SERVICES)
TITLE = "jaxckpt modules: an arrow points from a module to one it imports"


@dataclass
class Module:
    name: str  # dotted: jaxckpt._src.emergency.peers
    path: Path
    is_pkg: bool
    group: str
    label: str  # as drawn: emergency/peers
    imports: dict[str, str] = field(default_factory=dict)  # dotted name -> how (STRENGTH)


def classify(name: str) -> tuple[str, str] | None:
    """(group, label) of a dotted module name; None for the ``__init__`` of a _src folder."""
    parts = name.split(".")
    if parts[:2] != [PKG, "_src"]:
        return "facades", name
    rest = parts[2:]
    if len(rest) == 1 and rest[0] not in FOLDERS:
        return "core", rest[0]
    if len(rest) == 2 and rest[0] in FOLDERS:
        return rest[0], "/".join(rest)
    return None


def find_modules(root: Path = ROOT) -> tuple[dict[str, Module], dict[str, Module]]:
    """The drawn modules by dotted name, and the skipped ones: the ``__init__`` of
    ``jaxckpt/_src/`` and of each of its folders (a folder is drawn as its modules)."""
    modules: dict[str, Module] = {}
    skipped: dict[str, Module] = {}
    for path in sorted((root / PKG).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        kind = classify(name)
        if kind is None:
            skipped[name] = Module(name, path, is_pkg, "", name)
            continue
        modules[name] = Module(name, path, is_pkg, kind[0], kind[1])
    return modules, skipped


def drawn_files(root: Path = ROOT) -> dict[str, Path]:
    """Each drawn module's label -> its file: what the picture shows, for tests/test_docs.py."""
    return {m.label: m.path for m in find_modules(root)[0].values()}


STRENGTH = {"module": 2, "function": 1, "typing": 0}  # how an import is made, strongest first
HOW = {"module": "at module level", "function": "inside a function", "typing": "TYPE_CHECKING"}


def import_nodes(tree: ast.AST) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with how it runs: "module" level, in a "function", or "typing"."""

    def walk(node: ast.AST, how: str) -> Iterable[tuple[ast.Import | ast.ImportFrom, str]]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, how
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            how = "function" if how == "module" else how
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                yield from walk(stmt, "typing")
            for stmt in node.orelse:
                yield from walk(stmt, how)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, how)

    yield from walk(tree, "module")


def imported_names(module: Module, known: set[str]) -> dict[str, str]:
    """{dotted name: how} of the jaxckpt modules (in ``known``) that ``module`` imports."""
    package = module.name if module.is_pkg else module.name.rpartition(".")[0]
    found: dict[str, str] = {}

    def deepest(dotted: str) -> str:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    def add(name: str, how: str) -> None:
        if name and name != module.name and STRENGTH[how] > STRENGTH.get(found.get(name, ""), -1):
            found[name] = how

    tree = ast.parse(module.path.read_text(), str(module.path))
    for node, how in import_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PKG:
                    add(deepest(alias.name), how)
            continue
        if node.level:
            base_parts = package.split(".")
            base = ".".join(base_parts[: len(base_parts) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
        else:
            target = node.module or ""
        if target.split(".")[0] != PKG:
            continue
        for alias in node.names:
            sub = f"{target}.{alias.name}"  # ``from . import name``: the module, if one
            add(sub if sub in known else deepest(target), how)
    return found


def build_graph(root: Path = ROOT) -> dict[str, Module]:
    """The modules with their ``imports`` filled in. An import of a skipped package stands
    for the drawn modules its ``__init__`` imports (the names it re-exports), made the
    weaker of the two ways; an empty ``__init__`` gives none."""
    modules, skipped = find_modules(root)
    known = set(modules) | set(skipped)
    through = {name: imported_names(pkg, known) for name, pkg in skipped.items()}
    for module in modules.values():
        found: dict[str, str] = {}
        for name, how in imported_names(module, known).items():
            targets = {name: how}
            if name in through:
                targets = {
                    t: min(how, via, key=STRENGTH.__getitem__) for t, via in through[name].items()
                }
            for t, h in targets.items():
                if (
                    t in modules
                    and t != module.name
                    and STRENGTH[h] > STRENGTH.get(found.get(t, ""), -1)
                ):
                    found[t] = h
        module.imports = found
    return modules


def edges(modules: dict[str, Module]) -> Iterable[tuple[str, str]]:
    """(importer, imported) pairs, sorted."""
    for name in sorted(modules):
        for target in sorted(modules[name].imports):
            yield name, target


def depths(modules: dict[str, Module], names: Iterable[str]) -> dict[str, int]:
    """Import depth of each of ``names`` counting only imports among them made at run time.

    0: imports none of them; else 1 + the deepest one imported. Modules on an import cycle
    (possible through imports inside functions) share the depth of the cycle.
    """
    group = sorted(names)
    inside = set(group)
    succ = {
        n: sorted(t for t, how in modules[n].imports.items() if t in inside and how != "typing")
        for n in group
    }
    # Strongly connected components (Tarjan), so that a cycle cannot recurse forever.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    comp: dict[str, int] = {}
    comps: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in succ[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w not in comp and w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members: list[str] = []
            while True:
                w = stack.pop()
                comp[w] = len(comps)
                members.append(w)
                if w == v:
                    break
            comps.append(members)

    for v in group:
        if v not in index:
            connect(v)
    # Tarjan emits a component after every component it reaches: depths in emission order.
    comp_depth: list[int] = []
    for members in comps:
        below = [comp_depth[comp[w]] for v in members for w in succ[v] if comp[w] != comp[v]]
        comp_depth.append(1 + max(below) if below else 0)
    return {v: comp_depth[comp[v]] for v in group}


# ---------------------------------------------------------------------------------------------
# Layout: axes in inches (x 0..WIDTH, y 0..height), so sizes below read as inches.

WIDTH, DPI = 16.0, 110
FONT = 8.5
COLOURS = {
    "facades": "#7b4fa0",
    "emergency": "#c8302c",
    "cli": "#e07b00",
    "safetensors": "#2b8a3e",
    "export": "#0f8b9c",
    "core": "#2760a8",
    "io": "#6b4f1d",
    "goodput": "#8a6d00",
    "orbax": "#5a6a7a",
}
ERRORS = f"{PKG}.errors"
LEFT, RIGHT = 0.95, WIDTH - 0.2  # x range of the bands (row labels left of LEFT)
PAD = 0.09  # box padding around a label, inches
GAP = 0.16  # least space between two boxes of a row
PITCH = 0.55  # row pitch, inches
TIERS = (("facades",), FEATURES, ("core",), SERVICES)  # top to bottom; a tuple: blocks side by side


def tint(colour: str, amount: float) -> tuple[float, float, float]:
    """``colour`` mixed with white; amount 1: white."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


@dataclass
class Row:
    band: str  # group
    names: list[str]
    y: float
    lo: float
    hi: float


def pack(row: Row, want: dict[str, float], width: dict[str, float]) -> dict[str, float]:
    """x of each box of ``row``, in the order of ``row.names``: as near ``want`` as fits."""
    xs: list[float] = []
    for i, n in enumerate(row.names):
        x = max(want[n], row.lo + width[n] / 2)
        if i:
            prev = row.names[i - 1]
            x = max(x, xs[-1] + (width[prev] + width[n]) / 2 + GAP)
        xs.append(x)
    for i in range(len(xs) - 1, -1, -1):
        n = row.names[i]
        x = min(xs[i], row.hi - width[n] / 2)
        if i < len(xs) - 1:
            nxt = row.names[i + 1]
            x = min(x, xs[i + 1] - (width[nxt] + width[n]) / 2 - GAP)
        xs[i] = x
    if xs and xs[0] - width[row.names[0]] / 2 < row.lo - 1e-6:  # does not fit: spread evenly
        step = (row.hi - row.lo) / len(xs)
        xs = [row.lo + step * (i + 0.5) for i in range(len(xs))]
    return dict(zip(row.names, xs, strict=True))


def layout(
    modules: dict[str, Module], width: dict[str, float]
) -> tuple[
    dict[str, tuple[float, float]], dict[str, tuple[float, float, float, float]], list[Row], float
]:
    """Node centres, the rectangle (x0, y0, x1, y1) of each band or block, the rows, and the
    picture's height. Built bottom up: the errors floor, the services, the core, the
    features, the facades, the title."""
    by_group = {g: sorted(n for n in modules if modules[n].group == g) for g in GROUPS}
    by_group["facades"] = [n for n in by_group["facades"] if n != ERRORS]
    depth = {g: depths(modules, by_group[g]) for g in GROUPS}
    depth["facades"] = dict.fromkeys(by_group["facades"], 0)

    bands: dict[str, tuple[float, float, float, float]] = {}
    rows: list[Row] = []
    y_floor = 0.55
    y = y_floor + 0.4  # bottom of the next tier up
    for tier in reversed(TIERS):
        n_rows = max(max(depth[g].values(), default=0) + 1 for g in tier)
        rows_y = [y + 0.32 + PITCH * r for r in range(n_rows)]
        top = rows_y[-1] + 0.42
        # Blocks side by side, each as wide as its widest row needs (a lone group: all).
        need: dict[str, float] = {}
        for g in tier:
            per_row = [
                sum(width[n] + GAP for n in by_group[g] if depth[g][n] == r) for r in range(n_rows)
            ]
            need[g] = max(per_row) + 0.5
        spare = (RIGHT - LEFT - 0.2 * (len(tier) - 1)) / sum(need.values())
        x = LEFT
        for g in tier:
            w = need[g] * spare
            bands[g] = (x, y, x + w, top)
            for r in range(n_rows - 1, -1, -1):
                names = [n for n in by_group[g] if depth[g][n] == r]
                if names:
                    rows.append(Row(g, names, rows_y[r], x + 0.12, x + w - 0.12))
            x += w + 0.2
        y = top + 0.26
    height = y + 0.45  # the title above the facades

    rows.sort(key=lambda r: -r.y)  # top to bottom
    # Start evenly spread, then order rows by the mean x of their neighbours (barycentre
    # sweeps, down then up), which keeps a module near what it imports and what imports it.
    pos: dict[str, float] = {}
    for row in rows:
        step_x = (row.hi - row.lo) / len(row.names)
        pos.update({n: row.lo + step_x * (i + 0.5) for i, n in enumerate(row.names)})
    links: dict[str, list[str]] = {n: [] for n in pos}
    for a, b in edges(modules):
        if a in pos and b in pos and edge_kind(modules, a, b) not in ("upward", "service"):
            links[a].append(b)
            links[b].append(a)
    for sweep in range(8):
        order = rows if sweep % 2 == 0 else rows[::-1]
        for row in order:
            want = {
                n: sum(pos[m] for m in links[n]) / len(links[n]) if links[n] else pos[n]
                for n in row.names
            }
            row.names.sort(key=lambda n: (want[n], n))
            pos.update(pack(row, want, width))
        # Averaging pulls everything together: stretch each band back to its full width.
        for band in sorted({r.band for r in rows} - {"facades"}):
            band_rows = [r for r in rows if r.band == band]
            lo = min(pos[n] - width[n] / 2 for r in band_rows for n in r.names)
            hi = max(pos[n] + width[n] / 2 for r in band_rows for n in r.names)
            lo_to, hi_to = band_rows[0].lo, band_rows[0].hi
            scale = (hi_to - lo_to) / (hi - lo) if hi > lo else 1.0
            for band_row in band_rows:
                want = {n: lo_to + (pos[n] - lo) * scale for n in band_row.names}
                pos.update(pack(band_row, want, width))
    centres = {n: (pos[n], row.y) for row in rows for n in row.names}
    centres[ERRORS] = ((LEFT + RIGHT) / 2, y_floor)
    return centres, bands, rows, height


def edge_kind(modules: dict[str, Module], a: str, b: str) -> str:
    """How an edge is drawn: "within" a group; "feature" between two features or two
    services; "core" (into the core from a feature, a facade or a service); "service" (into
    a service from the core or a feature); "facade" (from a facade); "upward" (from the core
    or a service to a facade other than errors); "wrong" (from the core or a service into a
    feature: must not be)."""
    ga, gb = modules[a].group, modules[b].group
    below = ("core", *SERVICES)
    if ga in below and gb in FEATURES:
        return "wrong"
    if ga in below and gb == "facades":
        return "upward"
    if ga == gb:
        return "within"
    if ga == "facades":
        return "facade"
    if gb == "core":
        return "core"
    if gb in SERVICES and ga not in SERVICES:
        return "service"
    return "feature"


def summary(modules: dict[str, Module]) -> list[str]:
    """The lines printed: modules per group, edges, edges between groups."""
    all_edges = list(edges(modules))
    per_group = ", ".join(f"{g} {sum(m.group == g for m in modules.values())}" for g in GROUPS)
    how = {h: sum(modules[a].imports[b] == h for a, b in all_edges) for h in STRENGTH}
    between: dict[tuple[str, str], int] = {}
    for a, b in all_edges:
        key = (modules[a].group, modules[b].group)
        if key[0] != key[1]:
            between[key] = between.get(key, 0) + 1
    across = [
        f"{a}->{b} {n}"
        for (a, b), n in sorted(between.items())
        if {a, b} <= set(FEATURES) or {a, b} <= set(SERVICES)
    ]
    wrong = sum(edge_kind(modules, a, b) == "wrong" for a, b in all_edges)
    into = {
        k: sum(edge_kind(modules, a, b) == k for a, b in all_edges) for k in ("core", "service")
    }
    return [
        f"modules: {len(modules)} ({per_group})",
        f"edges: {len(all_edges)} ({how['function']} from inside functions, {how['typing']} "
        f"under TYPE_CHECKING); into {ERRORS}: {sum(b == ERRORS for _, b in all_edges)}",
        f"into the core from other groups: {into['core']}; into a service from the core or a "
        f"feature: {into['service']}; feature->feature or service->service: "
        f"{', '.join(across) or 'none'}",
        f"core or service -> feature edges: {wrong} (must be 0)",
    ]


def draw(modules: dict[str, Module], out: Path) -> None:
    """Render the graph to ``out`` (PNG). The one function that needs matplotlib."""
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    from PIL import Image  # comes with matplotlib

    fig = Figure(figsize=(WIDTH, 10.0), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")

    # Measure each label (inches, as the axes are) before laying out.
    texts = {
        n: ax.text(0, 0, m.label, ha="center", va="center", fontsize=FONT, zorder=5)
        for n, m in modules.items()
    }
    width = {n: t.get_window_extent().width / DPI + 2 * PAD for n, t in texts.items()}
    height = max(t.get_window_extent().height for t in texts.values()) / DPI + 2 * PAD
    centres, bands, rows, fig_height = layout(modules, width)
    fig.set_size_inches(WIDTH, fig_height)
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, fig_height)

    for g, (x0, y0, x1, y1) in bands.items():
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                boxstyle="round,pad=0,rounding_size=0.08",
                fc=tint(COLOURS[g], 0.93),
                ec=tint(COLOURS[g], 0.6),
                lw=0.8,
                zorder=0,
            )
        )
        count = sum(m.group == g for m in modules.values())
        upward = [
            f"{modules[a].label} -> {modules[b].label} ({HOW[modules[a].imports[b]]})"
            for a, b in edges(modules)
            if edge_kind(modules, a, b) == "upward" and b != ERRORS
        ]
        title = {
            "facades": f"public facades: jaxckpt/*.py ({count}, errors drawn as the floor)",
            "core": f"core: jaxckpt/_src/*.py ({count}), one row per import depth"
            + ("; upward: " + ", ".join(upward) if upward else ""),
        }.get(g, f"_src/{g}/ ({count})" + (": a service" if g in SERVICES else ""))
        ax.text(
            x0 + 0.08,
            y1 - 0.06,
            title,
            ha="left",
            va="top",
            fontsize=8.5,
            color=COLOURS[g],
            fontweight="bold",
            zorder=1,
        )
    core_rows = [r for r in rows if r.band == "core"]
    for depth, row in enumerate(sorted(core_rows, key=lambda r: r.y)):
        ax.text(
            LEFT - 0.08,
            row.y,
            f"depth {depth}",
            ha="right",
            va="center",
            fontsize=7.5,
            color="#666666",
        )
    for tier, label in ((FEATURES, "features"), (SERVICES, "services")):
        y0, y1 = bands[tier[0]][1], bands[tier[0]][3]
        ax.text(
            LEFT - 0.08,
            (y0 + y1) / 2,
            label,
            ha="right",
            va="center",
            fontsize=8.5,
            color="#444444",
            fontweight="bold",
            rotation=90,
        )

    # Nodes: a box per module, sized to its label; errors is the floor under everything.
    patches: dict[str, FancyBboxPatch] = {}
    for n, (x, y) in centres.items():
        w = RIGHT - LEFT if n == ERRORS else width[n]
        colour = COLOURS[modules[n].group]
        patches[n] = FancyBboxPatch(
            (x - w / 2, y - height / 2),
            w,
            height,
            boxstyle="round,pad=0,rounding_size=0.06",
            fc=tint(colour, 0.78),
            ec=colour,
            lw=1.0,
            zorder=4,
        )
        ax.add_patch(patches[n])
        texts[n].set_position((x, y))
    importers = sorted(a for a, b in edges(modules) if b == ERRORS)
    texts[ERRORS].set_text(
        f"{ERRORS}: imported by {len(importers)} modules of every layer "
        "(those with a dot at the top right; their arrows are left out)"
    )
    for n in importers:
        x, y = centres[n]
        ax.plot(
            x + width[n] / 2 - 0.05,
            y + height / 2 - 0.05,
            "o",
            ms=3.2,
            color=COLOURS["facades"],
            zorder=6,
        )

    # Edges, lightest first: into the core or a service from elsewhere, within the core,
    # then the rest.
    style = {  # kind: (alpha, line width); coloured as the importer's group, "wrong" red
        "core": (0.16, 0.7),
        "service": (0.16, 0.7),
        "facade": (0.3, 0.8),
        "within": (0.55, 0.9),
        "feature": (0.8, 1.3),
        "upward": (0.6, 1.0),
        "wrong": (1.0, 2.5),
    }
    for kind in style:
        for a, b in edges(modules):
            if b == ERRORS or edge_kind(modules, a, b) != kind:
                continue
            alpha, lw = style[kind]
            if kind == "within" and modules[a].group == "core":
                alpha = 0.4
            how = modules[a].imports[b]
            (xa, ya), (xb, yb) = centres[a], centres[b]
            rad = 0.0 if abs(xa - xb) < 0.05 else (0.08 if xa < xb else -0.08)
            if abs(ya - yb) < 0.05:  # same row: an arc about 0.35 inch over the boxes between
                rad = -0.7 / (xb - xa)
            ax.add_patch(
                FancyArrowPatch(
                    (xa, ya),
                    (xb, yb),
                    patchA=patches[a],
                    patchB=patches[b],
                    arrowstyle="-|>,head_length=5,head_width=2.4",
                    connectionstyle=f"arc3,rad={rad}",
                    color="#d00000" if kind == "wrong" else COLOURS[modules[a].group],
                    alpha=alpha,
                    lw=lw,
                    linestyle={"module": "-", "function": "--", "typing": ":"}[how],
                    shrinkA=1,
                    shrinkB=1,
                    zorder=2 if kind in ("core", "service") else 3,
                )
            )

    ax.text(0.2, fig_height - 0.2, TITLE, ha="left", va="top", fontsize=15, fontweight="bold")
    # The groups are named on their bands; the legend says how the arrows are drawn.
    handles: list[Artist] = [
        Line2D([], [], color="#555555", lw=1.0),
        Line2D([], [], color="#555555", lw=1.0, ls="--"),
        Line2D([], [], color="#555555", lw=1.0, ls=":"),
        Line2D([], [], color="#555555", lw=0.7, alpha=0.3),
    ]
    labels = [
        "import at module level",
        "import inside a function",
        "under TYPE_CHECKING",
        "into the core or a service from another band (light)",
    ]
    ax.legend(
        handles,
        labels,
        loc="upper right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    # 256 colours are plenty for flat boxes and thin lines, and keep the file small.
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    image = Image.open(buffer).convert("RGB")
    image = image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    image.save(out, format="png", optimize=True)


def main() -> None:
    """Print the summary and write the PNG (or, with ``--list``, the drawn modules)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "modules.png")
    ap.add_argument("--list", action="store_true", help="print the drawn modules; draw nothing")
    args = ap.parse_args()
    modules = build_graph()
    if args.list:
        for m in sorted(modules.values(), key=lambda m: (GROUPS.index(m.group), m.label)):
            print(f"{m.group:12} {m.label:24} {m.path.relative_to(ROOT)}")
        return
    for line in summary(modules):
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(modules, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
