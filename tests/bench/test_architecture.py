"""`das bench architecture`: the picture is drawn from real imports, and an import that goes away takes its
arrow with it."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from das.bench.architecture import ArchitectureError, import_graph, render_dot, write_architecture
from das.service.cli import program

app = program()

ROOT = Path(__file__).resolve().parents[2]


def _tiny_repo(root: Path, b_imports_a: bool = True) -> Path:
    """Two shipped packages `pkg.a` and `pkg.b` (folders a/ and b/), b's subpackage `core` importing a
    relatively-resolved sibling and, optionally, a module of `pkg.a`."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(
        '[tool.scikit-build]\nwheel.packages = { "pkg/a" = "a", "pkg/b" = "b" }\n')
    (root / "a").mkdir()
    (root / "a" / "__init__.py").write_text("")
    (root / "a" / "records.py").write_text("import json\nVALUE = 1\n")
    (root / "b" / "core").mkdir(parents=True)
    (root / "b" / "__init__.py").write_text("")
    (root / "b" / "core" / "__init__.py").write_text("")
    (root / "b" / "core" / "steps.py").write_text("from . import helpers\n")
    (root / "b" / "core" / "helpers.py").write_text(
        "def load():\n    from pkg.a.records import VALUE\n    return VALUE\n" if b_imports_a else "X = 2\n")
    return root


def test_the_repository_graph_holds_its_real_imports() -> None:
    graph = import_graph(ROOT)
    # scheduler/simulator.py: `from das.drafter.history import DrafterConfig, HistoryBank, StepDrafts`
    assert ("das.scheduler.simulator", "das.drafter.history") in graph.edges
    assert graph.room_edges[("das.scheduler", "das.drafter")] >= 1
    assert graph.modules["das.scheduler.simulator"] == "das.scheduler"
    # The layers: the drafter, the lowest, imports no other room.
    assert not [edge for edge in graph.room_edges if edge[0] == "das.drafter"]
    assert '"das.scheduler" -> "das.drafter"' in render_dot(graph)


def test_an_import_that_disappears_takes_its_arrow(tmp_path: Path) -> None:
    graph = import_graph(_tiny_repo(tmp_path / "with"))
    assert ("pkg.b.core.helpers", "pkg.a.records") in graph.edges  # inside a function: counted
    assert ("pkg.b.core.steps", "pkg.b.core.helpers") in graph.edges  # `from . import helpers`
    assert dict(graph.room_edges) == {("pkg.b.core", "pkg.a"): 1}
    assert '"pkg.b.core" -> "pkg.a" [label="1"];' in render_dot(graph)

    without = import_graph(_tiny_repo(tmp_path / "without", b_imports_a=False))
    assert ("pkg.b.core.helpers", "pkg.a.records") not in without.edges
    assert dict(without.room_edges) == {}
    assert "->" not in render_dot(without)


def test_rooms_fold_deeper_packages_at_the_depth(tmp_path: Path) -> None:
    graph = import_graph(_tiny_repo(tmp_path), depth=2)
    assert graph.modules["pkg.b.core.steps"] == "pkg.b"
    assert dict(graph.room_edges) == {("pkg.b", "pkg.a"): 1}
    with pytest.raises(ArchitectureError, match="depth"):
        import_graph(tmp_path, depth=1)


def test_write_without_svg_and_bad_roots(tmp_path: Path) -> None:
    root = _tiny_repo(tmp_path / "repo")
    result = write_architecture(root, tmp_path / "arch.dot", svg=False)
    assert (tmp_path / "arch.dot").read_text().startswith("// The code's rooms")
    assert (result.rooms, result.modules, result.room_edges, result.svg_path) == (3, 6, 1, None)
    with pytest.raises(ArchitectureError, match="pyproject.toml"):
        import_graph(tmp_path / "nowhere")
    (root / "a" / "broken.py").write_text("def (:\n")
    with pytest.raises(ArchitectureError, match="broken.py"):
        import_graph(root)


def test_the_command_writes_the_dot_file(tmp_path: Path) -> None:
    root = _tiny_repo(tmp_path)
    (root / "docs").mkdir()
    result = CliRunner().invoke(app, ["bench", "architecture", "--root", str(root), "--no-svg", "--json"])
    assert result.exit_code == 0, result.output
    assert '"room_edges": 1' in result.output
    assert '"pkg.b.core" -> "pkg.a"' in (root / "docs" / "architecture.dot").read_text()
    missing = CliRunner().invoke(app, ["bench", "architecture", "--root", str(tmp_path / "nowhere"), "--no-svg"])
    assert missing.exit_code != 0
