"""Imports run one way: protocol <- models <- coordinator / edge_client <- fleet <- ffr (the CLI on top)."""
from __future__ import annotations

import ast

import pytest
from conftest import REPO

LAYERS = ("protocol", "models", "coordinator", "edge_client", "fleet", "ffr")
MAY_IMPORT = {
    "protocol": {"protocol"},
    "models": {"protocol", "models"},
    "coordinator": {"protocol", "models", "coordinator"},
    "edge_client": {"protocol", "models", "edge_client"},
    "fleet": {"protocol", "models", "coordinator", "edge_client", "fleet"},
    "ffr": set(LAYERS),
}


def imported_packages(source: str) -> set[str]:
    """The project packages a module imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


@pytest.mark.parametrize("package", LAYERS)
def test_a_package_imports_only_itself_and_the_layers_below(package):
    wrong = {}
    for path in sorted((REPO / package).rglob("*.py")):
        upward = imported_packages(path.read_text()) - MAY_IMPORT[package]
        if upward:
            wrong[str(path.relative_to(REPO))] = sorted(upward)
    assert not wrong, f"imports that run upward: {wrong}"


def test_the_checker_sees_imports_inside_functions():
    assert imported_packages("def f():\n    from fleet.cli import add_commands\nimport models.cli.commands\n") == {
        "fleet",
        "models",
    }
