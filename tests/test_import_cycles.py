"""Import cycles among the package's modules, found from the source (ast, nothing imported).

Every import counts: module-level, inside functions (deferred imports) and under
`if TYPE_CHECKING:` (a type-only import still ties the two modules together: neither can
be read, moved or tested without the other). An edge goes to the module a statement names
(`from .x import y` to x.y when that is a module, else to x). A cycle is a strongly
connected component of that graph with more than one module.

The audit of issue 26 found three: the backend contract with its default hooks' runner,
loader, shards and distributed (and the models and layers behind them); core/params.py
with core/grammar/spec.py; gateway/app.py with its routers over require_api_key. They
must not come back. The cycles left (KNOWN_CYCLES, each a deferred import inside one
subsystem) are listed exactly, so that any new one fails here.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"core": "switchyard.core", "gateway": "switchyard.gateway", "backends": "switchyard.backends"}

# Deferred imports inside one subsystem, each with its reason; shrink this list, never grow it.
KNOWN_CYCLES = {
    # models/__init__ imports the transformers fallback on first use; the fallback asks it about remote code
    frozenset({"switchyard.core.models", "switchyard.core.models.transformers_fallback"}),
}


def package_modules(root: Path, packages: dict[str, str]) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package's __init__)} of every .py file under the packages."""
    modules = {}
    for folder, name in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join([name] + (parts[:-1] if is_package else parts))] = (path, is_package)
    return modules


def imported_modules(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its file."""
    found = set()

    def deepest_known(dotted: str) -> str | None:
        parts = dotted.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        return ".".join(parts) or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [deepest_known(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else deepest_known(source)
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t is not None)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, packages: dict[str, str] = PACKAGES) -> dict[str, set[str]]:
    modules = package_modules(root, packages)
    return {name: imported_modules(name, path, is_package, set(modules))
            for name, (path, is_package) in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(frozenset(component))
    return cycles


def cycle_path(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """One closed path through a component, for the failure message."""
    first = min(component)
    path, seen = [first], {first}
    while True:
        step = min(m for m in graph[path[-1]] if m in component)
        path.append(step)
        if step in seen:
            return path[path.index(step):]
        seen.add(step)


def _same_cycle(cycles: list[frozenset[str]], *modules: str) -> bool:
    return any(set(modules) <= cycle for cycle in cycles)


def test_the_finder_sees_deferred_and_type_only_cycles(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from .sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n")
    (package / "c.py").write_text("import pkg.a\n")  # imports into the cycle, not part of it
    graph = import_graph(tmp_path, {"pkg": "pkg"})
    assert graph["pkg.c"] == {"pkg.a"}
    assert import_cycles(graph) == [frozenset({"pkg.a", "pkg.sub.b"})]
    (package / "sub" / "b.py").write_text("x = 1\n")
    assert import_cycles(import_graph(tmp_path, {"pkg": "pkg"})) == []


def test_the_backend_contract_imports_none_of_cores_implementations():
    graph = import_graph()
    assert graph["switchyard.core.backend_contract"] <= {"switchyard.core.config"}


def test_the_three_audited_cycles_are_gone():
    cycles = import_cycles(import_graph())
    assert not _same_cycle(cycles, "switchyard.core.backend_contract", "switchyard.core.execution.runner")
    assert not _same_cycle(cycles, "switchyard.core.backend", "switchyard.core.execution.runner")
    assert not _same_cycle(cycles, "switchyard.core.backend", "switchyard.core.loader")
    assert not _same_cycle(cycles, "switchyard.core.backend", "switchyard.core.shards.distributed")
    assert not _same_cycle(cycles, "switchyard.core.backend", "switchyard.core.shards.group")
    assert not _same_cycle(cycles, "switchyard.core.params", "switchyard.core.grammar.spec")
    assert not _same_cycle(cycles, "switchyard.gateway.app", "switchyard.gateway.openai.routes")
    assert not _same_cycle(cycles, "switchyard.gateway.app", "switchyard.gateway.tgi.routes")


def test_the_quant_circles_are_broken():
    """The method table sits below the checkpoint readers (choice.py decides above both), and the
    scaled formats below the weights that hold them (weight.py makes them)."""
    cycles = import_cycles(import_graph())
    assert not _same_cycle(cycles, "switchyard.core.quant.methods", "switchyard.core.quant.hub")
    assert not _same_cycle(cycles, "switchyard.core.quant.scaled", "switchyard.core.quant.weight")


def test_the_base_backend_imports_no_implementation():
    """Backend holds the contract and defaults that need no implementation; the runner and the
    loaded model are named for types only, and shards come from ProcessGroupShards."""
    graph = import_graph()
    assert graph["switchyard.core.backend"] <= {"switchyard.core.backend_contract", "switchyard.core.config",
                                                 "switchyard.core.loader", "switchyard.core.execution.runner"}
    source = (ROOT / "core" / "backend.py").read_text()
    assert "if TYPE_CHECKING:" in source and "ModelRunner(" not in source


def test_the_serving_path_imports_no_benchmark():
    """What `switchyard serve` loads (the app, the server, the engine process) never reaches
    gateway/bench (the load generator `switchyard bench` runs)."""
    graph = import_graph()
    seen, todo = set(), ["switchyard.gateway.app", "switchyard.gateway.serve", "switchyard.core.engine.process"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    assert not {name for name in seen if name.startswith("switchyard.gateway.bench")}


def test_no_import_cycle_beyond_the_known_ones():
    graph = import_graph()
    new = [cycle for cycle in import_cycles(graph) if cycle not in KNOWN_CYCLES]
    assert not new, "new import cycles: " + "; ".join(" -> ".join(cycle_path(graph, c)) for c in new)
