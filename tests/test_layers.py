"""The package's shape: imports run one way through the layers, no module imports another that
imports it back (function-level imports included), and no module outgrows one concern."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "comfuse"
# each module's layer; a module imports only modules of its own layer or below
LAYERS = [
    ("settings", "errors", "report"),
    ("ir",),
    ("frontend",),
    ("planner",),
    ("codegen",),
    ("runtime",),
    ("rewrite",),
    ("pipeline",),
    ("region_op", "verdicts", "graph_check", "kernel_node", "inductor_pass", "attention_masks"),
    ("backend",),
    ("compiled",),  # (comfuse.compile sends graphs that train to the backend)
    ("__init__",),
    ("bench", "demo"),
    ("cli",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
MAX_LINES = 500


def modules() -> dict:
    """comfuse module name -> its source file."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict) -> set:
    """The comfuse modules ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name and t.startswith("comfuse"))
    return found


def layer_of(name: str) -> int:
    parts = name.split(".")
    return RANK["__init__" if len(parts) == 1 else parts[1]]


def graph() -> dict:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_imports_run_down_the_layers():
    wrong = [(a, b) for a, deps in graph().items() for b in deps
             if b != "comfuse" and layer_of(b) > layer_of(a)]
    assert not wrong, wrong


def test_the_planner_never_imports_code_generation_and_only_the_top_imports_bench():
    g = graph()
    assert not [(a, b) for a, deps in g.items() for b in deps
                if a.startswith("comfuse.planner") and b.startswith(("comfuse.codegen", "comfuse.runtime"))]
    assert not [(a, b) for a, deps in g.items() for b in deps
                if b.startswith("comfuse.bench") and not a.startswith(("comfuse.bench", "comfuse.cli", "comfuse.demo"))]


def test_no_import_circles():
    g = graph()
    state, stack, circles = {}, [], []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in g[n]:
            if m == "comfuse":  # (the package itself: the public API, imported by name only from above)
                continue
            if state.get(m) == "open":
                circles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"
    for n in sorted(g):
        if n not in state:
            visit(n)
    assert not circles, circles


def test_no_module_outgrows_one_concern():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_modules_import_no_private_names_of_others():
    """A name with a leading underscore stays in its module."""
    known = modules()
    private = []
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("comfuse")):
                private += [(name, a.name) for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not private, private
