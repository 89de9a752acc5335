"""The plugin contract's core side: the layering holds without exemptions (no import circle in
colibri_core; the store, a passive cache, imports no engine, model, planning or registry; nothing
probes the store or the model for optional behaviour or writes the store's attributes from outside),
declared routers are run by the core (each kind against an independent torch computation), and a
load that fails part-way leaves no thread or file behind."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_core import load
from colibri_core.demo import demo_model
from colibri_core.errors import ColibriError
from colibri_core.layers.moe import MoE
from colibri_core.layers.router import HashRouter, SigmoidGroupTopK, SoftmaxTopK, SqrtSoftplusTopK

CORE = Path(__file__).parents[1] / "colibri_core"
DEMO = demo_model()  # the bundled demo model (colibri_core/demo)
# What the store must not know: the engine, the model and its layers, the plugin registry, planning,
# the expert source in front of it, the server.
FORBIDDEN = ("colibri_core.engine", "colibri_core.model", "colibri_core.layers", "colibri_core.plugins",
             "colibri_core.planning", "colibri_core.experts", "colibri_core.remote", "colibri_core.generate",
             "colibri_core.server", "colibri_core.testing", "colibri_core.cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def not_dependencies(tree: ast.AST) -> set[int]:
    """ids of the nodes that make no dependency: imports under `if TYPE_CHECKING:` (annotations,
    never run) and a package's lazy re-exports (a module-level `__getattr__`: the facade a user
    imports from, `colibri_core.load`, which nothing inside the package goes through)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out.update(id(n) for n in ast.walk(node))
    for f in tree.body:
        if isinstance(f, ast.FunctionDef) and f.name == "__getattr__":
            out.update(id(n) for n in ast.walk(f))
    return out


def imported_modules(path: Path, name: str | None = None) -> set[str]:
    """The colibri_core modules (and other top-level names) `path` (module `name`) imports, at top
    level or inside functions: `from X import a` counts as importing X.a where that is a module, else X."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = not_dependencies(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            subs = {f"{module}.{a.name}" for a in node.names} & MODULES.keys()
            out.update(subs or {module})
            if len(subs) < len(node.names):
                out.add(module)
    return out


def test_no_import_circle_in_colibri_core():
    """Every module's imports (inside functions too) form no cycle: layers/ knows nothing of
    model.py, the conformance kit's modules depend one way, and so on."""
    graph = {m: {i for i in imported_modules(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import circles: " + "; ".join(
        ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles)


def test_the_import_walk_sees_imports_inside_functions(tmp_path):
    """The walk above finds `from . import x`, imports inside functions and relative parents (else
    it could pass blind), and leaves out what never runs."""
    module = tmp_path / "m.py"
    module.write_text("from . import router\nfrom ..store import usage\nimport numpy\n"
                      "def f():\n    from ..engine import Engine\n"
                      "if TYPE_CHECKING:\n    from .. import cli\n")
    assert imported_modules(module, "colibri_core.layers.m") == {
        "colibri_core.layers.router", "colibri_core.store.usage", "numpy", "colibri_core.engine"}


@pytest.mark.parametrize("path", sorted(p.name for p in (CORE / "store").glob("*.py")))
def test_the_store_imports_no_engine_model_or_registry(path):
    """The store is a passive cache: told what to read, it looks nothing up."""
    bad = sorted(m for m in imported_modules(CORE / "store" / path) if m.startswith(FORBIDDEN) or m.startswith("colibri_")
                 and not m.startswith("colibri_core"))
    assert not bad, f"colibri_core/store/{path} imports {bad}"


def test_importing_the_store_loads_no_engine_model_or_registry():
    code = ("import sys, colibri_core.store.store; "
            "print(sorted(m for m in sys.modules if m.startswith(%r)))" % (FORBIDDEN,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def names(node: ast.AST) -> str | None:
    """The last name of `store`, `self.store`, `engine.model`, …"""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def backchannels(path: Path) -> list[str]:
    """`getattr`/`hasattr` on a store or model (optional behaviour is declared in the contract, never
    probed), and an attribute of a store written outside colibri_core/store/ (`store.x = …`)."""
    tree = ast.parse(path.read_text())
    lazy = not_dependencies(tree)  # e.g. a package's lazy re-exports: `getattr(submodule, name)`
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and names(node.func) in ("getattr", "hasattr") and node.args
                and names(node.args[0]) in ("store", "model") and id(node) not in lazy):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and names(t.value) == "store" and "store" not in path.parts:
                out.append(f"line {node.lineno}: {ast.unparse(t)} = …")
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_backchannel_to_the_store_or_the_model(module):
    found = backchannels(MODULES[module])
    assert not found, f"{module}: " + "; ".join(found)


def test_the_backchannel_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self, store):\n    r = getattr(self.store, 'remote', None)\n    store.elsewhere = {}\n"
                   "    return hasattr(self.model, 'last_hidden')\n")
    assert len(backchannels(bad)) == 3


# ---- routers ----------------------------------------------------------------------------------
def torch_reference(logits, bias, k, score, renormalize, scaling, n_group=1, topk_group=1):
    """Routing computed with torch, independently of colibri's NumPy: (weights, ids)."""
    import torch

    t = torch.tensor(logits, dtype=torch.float64)
    s = {"softmax": t.softmax(-1), "sigmoid": t.sigmoid(), "sqrt_softplus": torch.nn.functional.softplus(t).sqrt()}[score]
    choice = s + (0 if bias is None else torch.tensor(bias, dtype=torch.float64))
    if n_group > 1:
        T, E = choice.shape
        group = choice.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)
        mask = torch.zeros_like(group).scatter_(1, group.topk(topk_group, dim=-1).indices, 1)
        choice = choice.masked_fill(~mask.bool().repeat_interleave(E // n_group, 1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return (w * scaling).numpy(), ids.numpy()


@pytest.mark.parametrize("kind", ["softmax", "softmax_renorm", "sigmoid_groups", "sqrt_softplus"])
def test_core_router_kinds_match_torch(kind):
    rng = np.random.default_rng(1)
    T, H, E, k = 7, 24, 16, 4
    weight = rng.normal(0, 0.5, (E, H)).astype(np.float32)
    bias = rng.normal(0, 0.1, E).astype(np.float32)
    x = rng.normal(0, 1, (T, H)).astype(np.float32)
    logits = x.astype(np.float64) @ weight.T.astype(np.float64)
    router, ref = {
        "softmax": (SoftmaxTopK(weight, k, False), dict(bias=None, score="softmax", renormalize=False, scaling=1)),
        "softmax_renorm": (SoftmaxTopK(weight, k, True), dict(bias=None, score="softmax", renormalize=True, scaling=1)),
        "sigmoid_groups": (SigmoidGroupTopK(weight, bias, k, n_group=4, topk_group=2, scaling=2.5),
                           dict(bias=bias, score="sigmoid", renormalize=True, scaling=2.5, n_group=4, topk_group=2)),
        "sqrt_softplus": (SqrtSoftplusTopK(weight, bias, k, scaling=1.5),
                          dict(bias=bias, score="sqrt_softplus", renormalize=True, scaling=1.5)),
    }[kind]
    weights, ids = router.route(x, np.arange(T))
    want_w, want_ids = torch_reference(logits, k=k, **ref)
    assert ids.dtype == np.int64 and weights.dtype == np.float32 and ids.shape == weights.shape == (T, k)
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-5, atol=1e-6)
    assert np.array_equal(router.predict(x, np.arange(T)), ids)  # identity input: predicts its own routing


def test_hash_router_routes_and_predicts_by_token_id():
    rng = np.random.default_rng(2)
    V, H, E, k = 50, 8, 16, 3
    table = np.stack([rng.permutation(E)[:k] for _ in range(V)])  # distinct experts per token
    weight = rng.normal(0, 0.5, (E, H)).astype(np.float32)
    router = HashRouter(weight, table, scaling=1.5)
    tokens = np.array([3, 49, 3, 0])
    x = rng.normal(0, 1, (4, H)).astype(np.float32)
    weights, ids = router.route(x, tokens)
    assert np.array_equal(ids, table[tokens]) and router.k == k
    scores = np.sqrt(np.log1p(np.exp(x.astype(np.float64) @ weight.T.astype(np.float64))))
    want = np.take_along_axis(scores, ids, -1)
    np.testing.assert_allclose(weights, 1.5 * want / want.sum(-1, keepdims=True), rtol=1e-5)
    garbage = rng.normal(0, 1, (4, H)).astype(np.float32)  # any residual stream: the ids come from the table
    assert np.array_equal(router.predict(garbage, tokens), ids)


def test_moe_block_refuses_what_is_not_a_router():
    with pytest.raises(ColibriError, match="MoE layer 3: the model declared .* not a colibri Router"):
        MoE(store=None, routers={3: np.zeros((4, 4))})


# ---- loading that fails part-way ----------------------------------------------------------------
def open_resources() -> tuple[int, int]:
    """(threads, file descriptors) of this process."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("where", ["model", "routers"])
def test_a_failed_load_leaves_no_thread_or_file_open(where, monkeypatch):
    """A plugin whose model raises, or declares routers for the wrong layers, fails in one line, and
    the store's I/O threads and every file opened before it are closed (three loads: no growth)."""
    from colibri_olmoe.model import Olmoe

    if where == "model":
        def broken(self, *a, **kw):
            raise ColibriError("the plugin's model failed")

        monkeypatch.setattr(Olmoe, "__init__", broken)
        match = "the plugin's model failed"
    else:
        monkeypatch.setattr(Olmoe, "routers", lambda self: {0: self.layer_routers[0]})
        match = r"declares routers for layers \[0\], but its MoE layers are \[0, 1, 2, 3\]"
    with pytest.raises(ColibriError, match=match):  # the first load imports and caches what it needs
        load(DEMO, cache_slots=2, usage=False)
    before = open_resources()
    for _ in range(3):
        with pytest.raises(ColibriError, match=match):
            load(DEMO, cache_slots=2, usage=False)
    assert open_resources() == before
