"""The package's shape: one installed namespace, imports that point one way, short functions (docs/design.md).

The repository keeps the compiler's stages as folders (`memsched/` the core, `passes/`,
`models/`, `cli/`); pyproject.toml installs them all inside the one package `memsched`. The
imports are read from the source (every `import` statement, function-level ones included)."""
from __future__ import annotations

import ast
import importlib.metadata
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the installed package it becomes
FOLDERS = {"memsched": "memsched", "cli": "memsched.cli", "models": "memsched.models", "passes": "memsched.passes"}
# layer -> the layers it may import (besides itself); the core imports no other layer, and the
# runtime (running and training with a plan) only the core
MAY_IMPORT = {"memsched": set(), "memsched.runtime": {"memsched"}, "memsched.models": {"memsched"},
              "memsched.passes": {"memsched", "memsched.models", "memsched.runtime"},
              "memsched.cli": {"memsched", "memsched.models", "memsched.passes", "memsched.runtime"}}
# the program's entry point (`python -m memsched`) is the one core module that starts the command line
ENTRY_POINTS = {ROOT / "memsched" / "__main__.py"}


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to: the longest package of FOLDERS it lies in."""
    layers = [name for name in MAY_IMPORT if module == name or module.startswith(name + ".")]
    return max(layers, key=len) if layers else None


def package_of(path: Path) -> str:
    """The installed package a source file lies in (`passes/swap/gaps.py`: memsched.passes.swap)."""
    parts = path.relative_to(ROOT).parts
    return ".".join([FOLDERS[parts[0]], *parts[1:-1]])


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, by absolute name (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = package_of(path).split(".")
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_every_package_folder_is_installed_inside_memsched():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(config["packages"])
    folders = {FOLDERS[init.relative_to(ROOT).parts[0]] + "".join(f".{p}" for p in init.relative_to(ROOT).parts[1:-1])
               for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert folders <= packages, f"packages missing from pyproject.toml: {sorted(folders - packages)}"
    assert all(name == "memsched" or name.startswith("memsched.") for name in packages)
    assert {k: v for k, v in config["package-dir"].items()} == {v: k for k, v in FOLDERS.items()}


def test_the_install_puts_one_top_level_package():
    distribution = importlib.metadata.distribution("memsched")
    top_level = (distribution.read_text("top_level.txt") or "").split()
    assert top_level == ["memsched"]
    assert [ep.value for ep in distribution.entry_points if ep.group == "console_scripts"] == ["memsched.cli:main"]


def test_imports_point_one_way():
    wrong = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in ENTRY_POINTS:
                continue
            layer = layer_of(package_of(path))
            for module in imported_modules(path):
                target = layer_of(module)
                if target is not None and target != layer and target not in MAY_IMPORT[layer]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
            assert not any(m.split(".")[0] in {"passes", "models", "cli"} for m in imported_modules(path)), path
    assert not wrong, "\n".join(wrong)


LONGEST_FUNCTION = 80     # lines, docstring included


def test_no_function_outside_tests_is_longer_than_a_screen():
    """A function longer than LONGEST_FUNCTION lines does more than one thing: split it."""
    long = []
    for folder in (*FOLDERS, "bench", "docs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.end_lineno - node.lineno + 1 > LONGEST_FUNCTION:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}, "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)


STORAGE_FACTS = {"VIEW_OPS", "INPLACE_OPS", "INPLACE_ANY_INPUT", "INPLACE_DATA_ONLY"}
STEP_KINDS = {"compute", "recompute", "swap_out", "swap_in", "free"}


def test_the_storage_rules_and_step_kinds_have_one_home_each():
    """The in-place and view sets are named only by the op table and the memory model (every
    other stage asks `ops.is_view`, `ops.overwritable_inputs`, `memory.alias_problem`), and
    a step kind is a `StepKind`, never a string compared, outside memsched/schedule.py."""
    homes = {ROOT / "memsched" / "ops.py", ROOT / "memsched" / "memory.py"}
    wrong = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id in STORAGE_FACTS and path not in homes:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} names {node.id}")
                if isinstance(node, ast.Compare) and path != ROOT / "memsched" / "schedule.py":
                    for side in (node.left, *node.comparators):
                        if isinstance(side, ast.Constant) and side.value in STEP_KINDS and \
                                any(isinstance(n, ast.Attribute) and n.attr == "kind"
                                    for n in ast.walk(node)):
                            wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} compares a kind with "
                                         f"{side.value!r}")
    assert not wrong, "\n".join(wrong)
