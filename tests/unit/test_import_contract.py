"""The layout's rules, checked on the source (DESIGN §7): algorithms import no transport, only a
service's edges see gRPC and its generated code, the product never imports the benchmarks or the
training scripts, and no two modules import each other, directly or round a circle (imports
inside functions count: they are circles all the same; imports for annotations only do not)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = sorted((ROOT / "services").rglob("*.py"))

GRPC = ("grpc", "grpc_health", "grpc_reflection", "specmesh.v1")
# Where each transport may be imported: a module's path relative to services/, by glob.
EDGES = {
    GRPC: ("*/wire.py", "*/grpc_server.py", "*/client.py", "common/grpc_aio.py"),
    ("redis",): ("memory/redis_*.py",),
    ("ray",): ("ray_app.py", "ray_router.py"),
    ("fastapi", "starlette", "uvicorn"): ("router/http_server.py",),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node, except inside ``if TYPE_CHECKING:`` (annotations only: never imported)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports when it runs, anywhere in it (``from a import b`` also as
    ``a.b``, which is a module when b is one)."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def within(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


@pytest.mark.parametrize("transport", list(EDGES), ids=lambda t: t[0])
def test_each_transport_is_imported_only_at_its_edges(transport):
    allowed = EDGES[transport]
    wrong = [
        f"{p.relative_to(ROOT)} imports {sorted(n for n in imports(p) if within(n, transport))}"
        for p in PRODUCT
        if any(within(n, transport) for n in imports(p))
        and not any(p.relative_to(ROOT / "services").match(g) for g in allowed)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_product_imports_neither_benchmarks_nor_training():
    wrong = [str(p.relative_to(ROOT)) for p in PRODUCT if any(within(n, ("bench", "training")) for n in imports(p))]
    assert not wrong, wrong


def import_graph() -> dict[str, set[str]]:
    names = {module_name(p): p for p in PRODUCT}
    return {m: {n for n in imports(p) if n in names and n != m} for m, p in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_round_a_circle():
    assert cycles(import_graph()) == []


def test_the_checks_catch_what_they_forbid():
    """The checkers themselves: a circle is found, a transport import is seen inside a function."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    sample = ROOT / "services" / "verifier" / "replica.py"
    assert "services.verifier.core" in imports(sample)
    assert within("grpc.aio", GRPC) and not within("grpcio_tools", GRPC)


def test_the_shared_cycle_types_load_without_torch():
    """SessionSpec, CycleRequest, CycleResult, Draft, Verdict and the refusals: what every service
    and the Ray app exchange, importable where torch is not."""
    import subprocess
    import sys

    code = "import sys, services.common.types, services.common.refusals; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
