"""The package's module-level imports run one way: integration -> ops -> kernels -> format, and
form no cycle (a cycle works only while its first use is deferred, and breaks on reordering)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_snapmla"
# A module may import from its own layer and the layers after it, never from one before it.
# ``testing`` serves the tests, benchmarks and demo; ``_checks`` is the ops layer's argument
# contract (the kernels check their own launch limits); ``_native`` loads the extension.
LAYERS = ["vllm_snapmla.integration", "vllm_snapmla.demo", "vllm_snapmla.testing",
          "vllm_snapmla.ops", "vllm_snapmla._checks", "vllm_snapmla.kernels",
          "vllm_snapmla._native", "vllm_snapmla.reference", "vllm_snapmla.format"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_statements(body):
    """The statements that run at import: the module's own, and those inside its top-level
    ``if``/``try``/``with`` blocks (function and class bodies are lazy on purpose)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level_statements(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level_statements(handler.body)


def _top_level_imports(path: Path) -> set[str]:
    """Modules of the package imported at module level, ``from package import module`` resolved
    to the module where it is one.  ``from package import name`` of a package's own attribute
    is an edge to the package (marked ``attr:``): it needs the package's ``__init__`` run to its
    end, also from inside the package."""
    found = set()
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _module_level_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vllm_snapmla")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the package, up level - 1 packages
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            if not base.startswith("vllm_snapmla"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else f"attr:{base}")
    return found


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _top_level_imports(p) for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int | None:
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return i
    return None


def test_the_graph_sees_the_package():
    """The checks below pass on an empty graph: the parser must find the known edges."""
    graph = _graph()
    assert {"vllm_snapmla.ops", "vllm_snapmla.integration.backend",
            "vllm_snapmla.kernels.sm90"} <= graph.keys()
    assert "vllm_snapmla.format" in graph["vllm_snapmla.ops"]
    assert any(t.removeprefix("attr:").startswith("vllm_snapmla.ops")
               for t in graph["vllm_snapmla.integration.backend"])


def test_imports_follow_the_layers():
    wrong = []
    for module, imports in _graph().items():
        here = _layer(module)
        for target in imports:
            there = _layer(target.removeprefix("attr:"))
            if here is not None and there is not None and there < here:
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


def test_no_import_cycle():
    graph = _graph()
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):]
                                                                 + [module]))
        if module in done:
            return
        path.append(module)
        for target in sorted(graph.get(module, ())):
            # Importing a submodule first imports its packages.  Those above this module are
            # already being imported (a package importing its own submodules is no cycle),
            # except a package whose attribute is imported: its __init__ must have finished.
            attribute = target.startswith("attr:")
            target = target.removeprefix("attr:")
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if (attribute and prefix == target) or not (
                        module == prefix or module.startswith(prefix + ".")):
                    visit(prefix)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
