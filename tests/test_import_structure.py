"""The package structure docs/ARCHITECTURE.md shows, checked on the source: `runner/`, `kernels/` and
`weight_updates/` import nothing from `rollout/` or `trainer_bridge/`; `kernels/` imports nothing of the
project; nothing in the product imports `bench/` or `tests/`; the step messages and the runner's config are
leaves (nothing of the project, not torch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("rollout", "runner", "kernels", "weight_updates", "trainer_bridge", "bench", "tests")
ENTRY_POINTS = {"rollout/cli.py"}  # the command line, which also starts the trainer_bridge demo (`python -m rollout demo`)


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (at module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imports_of(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_packages(p) for p in (ROOT / package).rglob("*.py")}


@pytest.mark.parametrize("package, forbidden", [
    ("runner", {"rollout", "trainer_bridge", "bench", "tests"}),
    ("weight_updates", {"rollout", "trainer_bridge", "runner", "bench", "tests"}),
    ("kernels", set(PROJECT) - {"kernels"}),
    ("rollout", {"trainer_bridge", "bench", "tests"}),
    ("trainer_bridge", {"bench", "tests"}),
])
def test_packages_import_only_downwards(package, forbidden):
    bad = {f: sorted(names & forbidden) for f, names in imports_of(package).items()
           if names & forbidden and f not in ENTRY_POINTS}
    assert not bad, f"{package}/ imports what it must not: {bad}"


@pytest.mark.parametrize("leaf", ["runner/messages.py", "runner/config.py"])
def test_shared_vocabulary_modules_are_leaves(leaf):
    names = imported_packages(ROOT / leaf)
    assert not names & (set(PROJECT) | {"torch", "numpy"}), sorted(names)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from rollout.engine import Engine\n    import runner.loader\n")
    assert imported_packages(f) == {"rollout", "runner"}
