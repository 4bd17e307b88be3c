"""The import picture of src/dare: packages in layers that only import downwards, and no import circle.

Imports inside functions count (a lazy import that closes a circle is still a circle); imports under
``if TYPE_CHECKING:`` do not (annotations only). A package may import any package of a lower layer, never one of
its own layer or above: the models never import the planner, no algorithm imports the trainer, and the typed
configuration machinery imports nothing of dare.
"""
import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = [
    {"config", "collectives", "files"},  # typed configs; collectives and whole-file writes every layer above may use
    {"models"},  # the families, loading, the native modules
    {"diffusion"},  # noise, corruption, log-likelihoods
    {"rollout", "rewards", "data"},  # decoding, rewards, datasets and templates
    {"algorithms"},  # the hooks of every method
    {"eval"},  # the evaluation runner and its integrations
    {"trainer"},  # the loop, its stages, checkpoints, recipes
    {"plan", "quickstart"},  # what drives the trainer
    {"comparison"},  # dare compare: runs the quickstart's stages for every method
    {"commands"},  # one module per dare command
    {"cli"},  # the command line that finds them
]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "dare").rglob("*.py"):
        name = ".".join(f.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = f
    return out


def _type_checking_nodes(tree) -> set:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _targets(name: str, path: Path, node, modules: dict) -> list[str]:
    """The dare modules an import node loads (a submodule named in ``from pkg import sub`` counts as the submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
        names = subs + ([target] if len(subs) < len(node.names) else [])
    out = []
    for n in names:
        parts = n.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts and parts[0] == "dare" and ".".join(parts) != name:
            out.append(".".join(parts))
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                graph[name].update(_targets(name, path, node, modules))
    return graph


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules() if m != "dare"}
    assert packages <= set(LAYER), f"packages without a layer in this test: {sorted(packages - set(LAYER))}"


def test_packages_import_only_lower_layers():
    upward = sorted(f"{a} -> {b}" for a, bs in import_graph().items() for b in bs
                    if a != "dare" and b != "dare" and _package(a) != _package(b)
                    and LAYER[_package(b)] >= LAYER[_package(a)])
    assert not upward, "imports of a package of the same or a higher layer:\n" + "\n".join(upward)


def test_no_import_circle():
    graph = import_graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    import sys
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in list(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
