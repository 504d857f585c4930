"""The quantization table's rows (core/quant/methods.py `QuantMethod`) hold only what the code
reads: each field is read (`<expr>.<field>`, outside the row's own `__post_init__` check) by a
module that can hold a row, i.e. the table's module or one that imports it. A field kept only
as documentation, which then goes stale, fails here (issue 38: formats, checkpoint_keys,
replaces, refusal)."""
from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from switchyard.core.quant.methods import QuantMethod

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "gateway", "backends")  # switchyard.<package>, one folder each
TABLE = "core.quant.methods"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, tree: ast.Module) -> set[str]:
    """Every module (and module.name) that `path` imports from, absolute and without "switchyard."."""
    package = list(path.relative_to(ROOT).parent.parts)  # what `from .` names
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else [])).removeprefix("switchyard.")
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("switchyard.") for alias in node.names}
    return found


def _reads(tree: ast.Module) -> set[str]:
    """The attribute names read in `tree`, outside QuantMethod.__post_init__."""
    skipped = {id(node) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) and cls.name == "QuantMethod"
               for method in cls.body if isinstance(method, ast.FunctionDef) and method.name == "__post_init__"
               for node in ast.walk(method)}
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in skipped}


def table_modules() -> dict[str, ast.Module]:
    """The table's module and every module importing it, by name."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            if _module_name(path) == TABLE or TABLE in _imports(path, tree):
                modules[_module_name(path)] = tree
    return modules


def test_the_table_is_found_with_its_readers():
    modules = table_modules()
    assert {TABLE, "core.capabilities", "core.loader", "gateway.cli", "backends.cpu.backend"} <= set(modules)


def test_every_field_of_a_row_is_read():
    read = set().union(*map(_reads, table_modules().values()))
    assert [field.name for field in fields(QuantMethod) if field.name not in read] == []
