"""The rooms of the lab and the arrows between them, read from the project's own imports.

A *room* is a package that answers one question: a first-level subpackage of ``lab`` or ``simulator``
(``lab.kv_cache``, ``simulator.twins``), the modules at a package's top (``lab``: errors, checks, hardware;
``simulator``: its public surface and ``bench``), ``paged_kernels``, ``app_pages`` and ``app``. A ``__main__``
belongs to the room of the command line it starts.

    python scripts/rooms.py            # print the picture (Mermaid) of the rooms and their arrows
    python scripts/rooms.py --write    # write it into docs/architecture.md, between its markers

The allowed arrows are written once, in the table of docs/architecture.md; ``tests/test_import_direction.py``
checks the imports against it and the picture against the imports.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("paged_kernels", "lab", "simulator", "app_pages")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- rooms:begin (scripts/rooms.py --write) -->", "<!-- rooms:end -->"
ENTRY_POINTS = {"lab.__main__": "lab.cli", "simulator.__main__": "simulator"}


def modules() -> dict[str, Path]:
    """Every module of ours by its dotted name (a package by its ``__init__``)."""
    found = {"app": ROOT / "app.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _known(name: str) -> str | None:
    """The module of ours that ``name`` (a module or an attribute of one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {m for alias in node.names if (m := _known(alias.name))}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    # ``from package import name``: the submodule when ``name`` is one, else the package (or module) itself
    return {m for alias in node.names
            if (m := (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else _known(base)))}


def import_graph() -> nx.DiGraph:
    """Module -> module for every import statement of ours, at module level or inside a function (a deferred import
    is still an arrow)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph.add_edges_from((module, target) for target in _imported(module, node) - {module})
    return graph


def room_of(module: str) -> str:
    """The room a module lives in."""
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    parts = module.split(".")
    if parts[0] in ("lab", "simulator") and len(parts) > 1 and (ROOT / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def rooms() -> list[str]:
    return sorted({room_of(m) for m in MODULES})


def room_graph(graph: nx.DiGraph | None = None) -> nx.DiGraph:
    """Room -> room, each arrow carrying the module imports behind it (``via``)."""
    rooms_ = nx.DiGraph()
    rooms_.add_nodes_from(rooms())
    for a, b in (graph or import_graph()).edges:
        ra, rb = room_of(a), room_of(b)
        if ra != rb:
            if not rooms_.has_edge(ra, rb):
                rooms_.add_edge(ra, rb, via=[])
            rooms_.edges[ra, rb]["via"].append(f"{a} -> {b}")
    return rooms_


def allowed_arrows(text: str | None = None) -> dict[str, set[str]]:
    """The table of docs/architecture.md: each room (first column) and the rooms it may import (last column)."""
    text = ARCHITECTURE.read_text() if text is None else text
    allowed = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (room := re.fullmatch(r"`([\w.]+)`", cells[0])):
            allowed[room.group(1)] = set(re.findall(r"`([\w.]+)`", cells[-1]))
    return allowed


def mermaid(graph: nx.DiGraph | None = None) -> str:
    """The rooms as a Mermaid flowchart: one box per package, an arrow per room that imports another (but the arrows
    into ``lab``'s foundation, which every room may import)."""
    rooms_ = room_graph(graph)
    node = {r: r.replace(".", "_") for r in rooms_}
    lines = ["```mermaid", "flowchart TB"]
    for package in ("app", "app_pages", "simulator", "lab", "paged_kernels"):
        members = sorted(r for r in rooms_ if r.split(".")[0] == package)
        if package in ("lab", "simulator"):
            lines.append(f"  subgraph {package}_pkg[\"{package}/\"]")
            lines += [f"    {node[r]}[\"{r.partition('.')[2] or f'{package} (top)'}\"]" for r in members]
            lines.append("  end")
        else:
            lines += [f"  {node[r]}[\"{r}\"]" for r in members]
    # every room builds on lab's foundation (errors, checks): those arrows are left out of the picture
    lines += [f"  {node[a]} --> {node[b]}" for a, b in sorted(rooms_.edges) if b != "lab"]
    lines.append("```")
    return "\n".join(lines)


def write(path: Path = ARCHITECTURE) -> bool:
    """Put the picture between the markers of ``path``; True if it changed."""
    text = path.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    new = text[:start] + "\n" + mermaid() + "\n" + text[end:]
    path.write_text(new)
    return new != text


def drawn(text: str | None = None) -> str:
    """The picture docs/architecture.md holds now."""
    text = ARCHITECTURE.read_text() if text is None else text
    return text[text.index(BEGIN) + len(BEGIN): text.index(END)].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the picture into docs/architecture.md")
    args = parser.parse_args(argv)
    if args.write:
        print("docs/architecture.md:", "updated" if write() else "already current")
    else:
        print(mermaid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
