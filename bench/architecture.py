"""The code's architecture picture, drawn from its imports (`das bench architecture`).

Every Python module of the packages that `pyproject.toml` ships (`[tool.scikit-build] wheel.packages`) is parsed
with `ast` (nothing is imported, so the picture needs no vLLM). A module belongs to a room: its package cut to
`depth` dotted names (depth 3: `das.service.engine.vllm.cpu_fixes.x` is in `das.service.engine`, `das.service.cli` in
`das.service`). An edge from room A to room B says that some module of A imports some module of B; its label counts
those module pairs. Imports inside functions and under `TYPE_CHECKING` count too: they are dependencies all the
same. The rooms' folders come from the code, so the picture follows any re-housing without edits here."""

from __future__ import annotations

import ast
import shutil
import subprocess
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console


class ArchitectureError(ValueError):
    """The repository cannot be read: no pyproject.toml, no shipped packages, or a module that does not parse."""


@dataclass(frozen=True)
class ImportGraph:
    """Modules, their rooms, and the module-level import edges between modules of the shipped packages.

    Invariants: every module of `edges` is in `modules`; no edge is a self-import."""

    modules: dict[str, str]  # dotted module name -> its room (a dotted package name)
    edges: frozenset[tuple[str, str]]  # (importer, imported), both dotted module names
    room_edges: Counter[tuple[str, str]] = field(default_factory=Counter)  # (room, room) -> module pairs, A != B

    def rooms(self) -> dict[str, list[str]]:
        """Each room's modules, sorted."""
        out: dict[str, list[str]] = {}
        for module, room in sorted(self.modules.items()):
            out.setdefault(room, []).append(module)
        return out


def shipped_packages(root: Path) -> dict[str, Path]:
    """The import name and folder of every package `pyproject.toml` ships, e.g. `das.drafter` -> `ROOT/drafter`."""
    pyproject = root / "pyproject.toml"
    try:
        config = tomllib.loads(pyproject.read_text())
        mapping = config["tool"]["scikit-build"]["wheel"]["packages"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        raise ArchitectureError(f"{pyproject}: no [tool.scikit-build] wheel.packages to read ({exc})") from exc
    return {name.replace("/", "."): root / folder for name, folder in mapping.items()}


def _module_name(package: str, folder: Path, path: Path) -> tuple[str, bool]:
    """Dotted name of the module at `path` under `folder` (the files of `package`), and whether it is a package."""
    parts = list(path.relative_to(folder).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([package, *parts]), is_package


def _imported_names(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Every dotted name an import statement in `tree` may refer to, relative imports resolved. For `from a import
    b` both `a.b` (b may be a module) and `a` are returned; the caller keeps the ones that are modules."""
    names: list[str] = []
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            names.append(base)
            names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _room(module: str, is_package: bool, depth: int) -> str:
    """The room of `module`: the package it is (or lies in), cut to `depth` dotted names."""
    package = module if is_package else module.rsplit(".", 1)[0]
    return ".".join(package.split(".")[:depth])


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    """The module of the shipped packages that `name` refers to: the longest dotted prefix that is a module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(root: Path, depth: int = 3) -> ImportGraph:
    """Parse every module of the shipped packages under `root` and collect their imports of each other.

    `depth` >= 2 is how many dotted names a room keeps (`das.service` is 2, `das.service.engine` is 3)."""
    if depth < 2:
        raise ArchitectureError(f"depth must be at least 2 (das.<package>), got {depth}")
    sources: dict[str, tuple[Path, bool]] = {}
    for package, folder in shipped_packages(root).items():
        if not folder.is_dir():
            raise ArchitectureError(f"{folder}: the folder of {package} named in pyproject.toml is missing")
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            name, is_package = _module_name(package, folder, path)
            sources[name] = (path, is_package)
    modules = {name: _room(name, is_package, depth) for name, (_, is_package) in sources.items()}
    edges: set[tuple[str, str]] = set()
    for name, (path, is_package) in sources.items():
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as exc:
            raise ArchitectureError(f"{path}: does not parse: {exc}") from exc
        for imported in _imported_names(tree, name, is_package):
            target = _resolve(imported, modules)
            if target is not None and target != name:
                edges.add((name, target))
    room_edges: Counter[tuple[str, str]] = Counter(
        (modules[a], modules[b]) for a, b in edges if modules[a] != modules[b])
    return ImportGraph(modules=modules, edges=frozenset(edges), room_edges=room_edges)


_LAYER_COLOURS = ("#e6f0fa", "#e9f5ee", "#fdf3e1", "#f3e8fa", "#f5f5f5")


def _quote(text: str) -> str:
    """A Graphviz string; `text` may hold Graphviz's own `\\n` line breaks, which stay as they are."""
    return '"' + text.replace('"', '\\"') + '"'


def render_dot(graph: ImportGraph) -> str:
    """The graph as Graphviz text: one box per room listing its modules, boxes grouped by top package, one arrow
    per pair of rooms (importer -> imported) labelled with the number of module imports behind it."""
    rooms = graph.rooms()
    tops = sorted({".".join(room.split(".")[:2]) for room in rooms})
    lines = [
        "// The code's rooms and their imports. Generated by `das bench architecture` from the sources",
        "// (bench/architecture.py); do not edit by hand, regenerate.",
        "digraph architecture {",
        '  graph [rankdir=BT, fontname="Helvetica", fontsize=12, nodesep=0.3, ranksep=0.5, newrank=true];',
        '  node  [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.1,0.05"];',
        '  edge  [color="#555555", fontname="Helvetica", fontsize=8, arrowsize=0.6];',
    ]
    for index, top in enumerate(tops):
        colour = _LAYER_COLOURS[index % len(_LAYER_COLOURS)]
        members_of_top = {room: members for room, members in rooms.items()
                          if ".".join(room.split(".")[:2]) == top}
        # A package of one room needs no frame title: its box names it.
        title = top if len(members_of_top) > 1 else ""
        lines.append(f"  subgraph {_quote('cluster_' + top)} {{")
        lines.append(f'    label={_quote(title)}; style="rounded"; color="#888888";')
        for room, members in members_of_top.items():
            short = [m[len(room) + 1:] if m != room else "__init__" for m in members]
            label = f"{room}\\n({len(members)} modules)\\n" + "\\n".join(
                ", ".join(short[i:i + 4]) for i in range(0, len(short), 4))
            lines.append(f'    {_quote(room)} [label={_quote(label)}, fillcolor="{colour}"];')
        lines.append("  }")
    for (a, b), count in sorted(graph.room_edges.items()):
        lines.append(f"  {_quote(a)} -> {_quote(b)} [label={_quote(str(count))}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ArchitectureResult:
    """What `das bench architecture` wrote: the .dot file, and the .svg or why there is none."""

    dot_path: str
    rooms: int
    modules: int
    room_edges: int
    svg_path: str | None
    svg_skipped: str | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def print(self, console: Console) -> None:
        console.print(f"{self.dot_path}: {self.rooms} rooms, {self.modules} modules, {self.room_edges} arrows")
        if self.svg_path:
            console.print(self.svg_path)
        elif self.svg_skipped:
            console.print(f"no .svg: {self.svg_skipped}")


def write_architecture(root: Path, dot_path: Path, svg: bool = True, depth: int = 3) -> ArchitectureResult:
    """Regenerate `dot_path` from the imports under `root`; with `svg`, render the .svg beside it with Graphviz's
    `dot` when it is installed (else the result says it was skipped)."""
    graph = import_graph(root, depth=depth)
    dot_path.write_text(render_dot(graph))
    svg_path: Path | None = None
    skipped: str | None = None
    if svg:
        exe = shutil.which("dot")
        if exe is None:
            skipped = "Graphviz's `dot` is not installed (apt-get install graphviz); only the .dot file was written"
        else:
            svg_path = dot_path.with_suffix(".svg")
            subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(svg_path)], check=True, timeout=120)
    return ArchitectureResult(dot_path=str(dot_path), rooms=len(graph.rooms()), modules=len(graph.modules),
                              room_edges=len(graph.room_edges), svg_path=str(svg_path) if svg_path else None,
                              svg_skipped=skipped)
