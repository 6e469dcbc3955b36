"""The package's module-level imports run one way: integration -> ops -> kernels -> format, and
form no cycle (a cycle works only while its first use is deferred, and breaks on reordering)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_snapmla"
# A module may import from its own layer and the layers after it, never from one before it.
LAYERS = ["vllm_snapmla.integration", "vllm_snapmla.demo", "vllm_snapmla.ops",
          "vllm_snapmla.kernels", "vllm_snapmla.reference", "vllm_snapmla.format"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """Modules of the package imported at module level (not inside functions: those are lazy
    on purpose), ``from package import module`` resolved to the module where it is one."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vllm_snapmla")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_snapmla"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if _exists(candidate) else node.module)
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


def test_imports_follow_the_layers():
    wrong = []
    for module, imports in _graph().items():
        here = _layer(module)
        for target in imports:
            there = _layer(target)
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
            # Importing a submodule first imports its packages (those above this module are
            # already being imported: a package importing its own submodules is no cycle).
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if not (module == prefix or module.startswith(prefix + ".")):
                    visit(prefix)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
