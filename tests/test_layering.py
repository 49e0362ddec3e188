"""The layering, pinned by an import scan of the source (no imports are executed).

    kernels  <-  core  <-  {lang, adapters, server}  <-  app (cli, demo, bench)
    core:  vocabulary  <-  {mem_cache, models}  <-  model_executor  <-  scheduler  <-  engine

kernels import nothing of the package; core imports no frontend or app module, and inside core
each floor imports only itself and the floors below; lang, adapters and server import none of each other; nothing below the app layer imports it; and no two modules
import each other, directly or round a circle (lazy imports inside functions count; imports under
`if TYPE_CHECKING:` do not, as they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> the package it installs as (pyproject's package-dir mapping)
SOURCE_DIRS = {"radix_backend": "radix_backend", "kernels": "radix_backend.kernels", "lang": "radix_backend.lang",
               "adapters": "radix_backend.adapters"}
APP = ("radix_backend.cli", "radix_backend.demo", "radix_backend.bench", "radix_backend.__main__")
FRONTENDS = ("radix_backend.lang", "radix_backend.adapters", "radix_backend.server")
ALLOWED = {  # layer -> layers it may import
    "kernels": {"kernels"},
    "core": {"kernels", "core"},
    "radix_backend.lang": {"kernels", "core", "radix_backend.lang"},
    "radix_backend.adapters": {"kernels", "core", "radix_backend.adapters"},
    "radix_backend.server": {"kernels", "core", "radix_backend.server"},
    "app": {"kernels", "core", *FRONTENDS, "app"},
}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in SOURCE_DIRS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if folder == "radix_backend" and parts and parts[0] in ("kernels", "lang", "adapters"):
                continue  # not a real folder there (mapped), but be safe
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    if module.startswith("radix_backend.kernels"):
        return "kernels"
    for front in FRONTENDS:
        if module == front or module.startswith(front + "."):
            return front
    if any(module == a or module.startswith(a + ".") for a in APP):
        return "app"
    return "core"


# Inside core, floors from the bottom: a module imports its own floor or lower ones, and the
# sub-packages of one floor import none of each other (mem_cache knows no model, and no scheduler).
CORE_FLOORS: tuple[dict[str, tuple[str, ...]], ...] = (  # floor -> {part: its packages or modules}
    {"vocabulary": ()},  # the root modules not named below: config, sampling_params, outputs, errors, ...
    {"mem_cache": ("radix_backend.mem_cache",), "models": ("radix_backend.models",)},
    {"model_executor": ("radix_backend.model_executor",)},
    {"scheduler": ("radix_backend.scheduler",)},
    {"engine": ("radix_backend.engine", "radix_backend.engine_like", "radix_backend.request_builder", "radix_backend")},
)


def _core_floor(module: str) -> tuple[int, str]:
    """(floor, part) of a core module."""
    for level, parts in enumerate(CORE_FLOORS):
        for part, names in parts.items():
            if module in names or any(n != "radix_backend" and module.startswith(n + ".") for n in names):
                return level, part
    return 0, "vocabulary"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, skipping `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement loads (a submodule rather than its package when
    `from package import submodule`)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    out = set()
    for name in names:
        while name and name not in MODULES:  # `import a.b.c` of a name inside a module
            name = name.rsplit(".", 1)[0] if "." in name else ""
        if name:
            out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        deps: set[str] = set()
        for node in _import_nodes(tree):
            deps |= _resolve(module, path, node)
        deps.discard(module)
        graph[module] = deps
    return graph


GRAPH = _graph()


def test_the_scan_sees_the_package():
    assert {"radix_backend.engine", "radix_backend.kernels.registry", "radix_backend.lang.api",
            "radix_backend.adapters.langchain", "radix_backend.server.app", "radix_backend.bench.peers"} <= set(MODULES)
    assert "radix_backend.kernels.attention_base" in GRAPH["radix_backend.kernels.registry"]
    assert "radix_backend.scheduler.scheduler" in GRAPH["radix_backend.engine"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_stay_in_their_layers(module):
    layer = _layer(module)
    bad = sorted(dep for dep in GRAPH[module] if _layer(dep) not in ALLOWED[layer])
    assert not bad, f"{module} ({layer}) imports {bad}, outside {sorted(ALLOWED[layer])}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "core"))
def test_core_modules_import_only_their_floor_or_lower(module):
    level, part = _core_floor(module)
    bad = []
    for dep in GRAPH[module]:
        if _layer(dep) != "core":
            continue
        dep_level, dep_part = _core_floor(dep)
        if dep_level > level or (dep_level == level and dep_part != part):
            bad.append(f"{dep} ({dep_part})")
    assert not bad, f"{module} ({part}) imports {sorted(bad)} from its own floor's neighbour or above"


def test_the_core_floors_are_real_packages():
    for parts in CORE_FLOORS[1:4]:
        for (package,) in parts.values():
            assert any(m.startswith(package + ".") for m in MODULES), package


def test_no_import_circles():
    """Tarjan's strongly connected components: every one must be a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"
