"""The plugin author's guide (docs/plugins.md) is tested, not just written (datasette's
test_plugin_hooks_are_documented, extended to the whole public API):

- every module the guide declares public has an `__all__` equal to the names the guide lists, and
  every name exists; the names promised so far (STABLE) never disappear;
- every hook in hookspecs.py is documented with its exact signature, and no other;
- every MoEModel method, every field of the layout and of `Architecture`, and every attribute of
  `ConformanceSuite` is explained;
- the guide's code blocks marked with a file are that file (its pieces, in order), and every file
  of the example plugin is quoted;
- the example's code and the shipped plugins' model code import only the public API.
"""
import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

from colibri_core import hookspecs
from colibri_core.hookspecs import Architecture
from colibri_core.layout import ContainerLayout, ExpertNames
from colibri_core.model import MoEModel

REPO = Path(__file__).resolve().parent.parent
GUIDE = (REPO / "docs" / "plugins.md").read_text()
EXAMPLE = REPO / "examples" / "qwen3moe"

# Promised stable within a major version: may grow, never shrink (docs/plugins.md, "the public API").
STABLE = {
    "colibri_core": ["load", "Engine", "dequantize", "ColibriError", "__version__"],
    "colibri_core.hookspecs": ["hookimpl", "Architecture"],
    "colibri_core.errors": ["ColibriError"],
    "colibri_core.model": ["MoEModel", "Weights", "linear", "linears", "embed"],
    "colibri_core.layout": ["ContainerLayout", "ExpertNames"],
    "colibri_core.kv": ["State", "cache_arrays", "load_cache_arrays"],
    "colibri_core.kv.cache": ["KVCache", "Rows"],
    "colibri_core.probe": ["record"],
    "colibri_core.layers.norm": ["rms_norm", "rms_norm_zero_centred", "rms_norm_gated"],
    "colibri_core.layers.rope": ["Rope", "apply_rotate_half", "apply_interleaved"],
    "colibri_core.layers.attention": ["gqa_attention", "AttnBlock", "gqa_block"],
    "colibri_core.layers.router": ["Router", "SoftmaxTopK", "SigmoidGroupTopK", "SqrtSoftplusTopK", "HashRouter",
                                   "topk", "softmax_topk", "sigmoid_group_topk", "sqrt_softplus"],
    "colibri_core.layers.mlp": ["swiglu_mlp"],
    "colibri_core.layers.shared_expert": ["SharedExpert"],
    "colibri_core.layers.mla": ["MLA", "MLACache", "MLADims"],
    "colibri_core.layers.dsa": ["Indexer"],
    "colibri_core.layers.deltanet": ["DeltaNetDims", "DeltaNetState", "GatedDeltaNet"],
    "colibri_core.layers.gated_attention": ["GatedAttention"],
    "colibri_core.store.policies": ["CachePolicy"],
    "colibri_core.convert": ["convert_checkpoint"],
    "colibri_core.testing": ["ConformanceSuite", "DROP"],
}


def documented_api() -> dict[str, list[str]]:
    """{module: [names]} from the guide's reference section (### `module`, then | `name` | rows)."""
    section = GUIDE.split("<!-- public-api -->")[1].split("<!-- /public-api -->")[0]
    api: dict[str, list[str]] = {}
    module = None
    for line in section.splitlines():
        if m := re.fullmatch(r"### `([\w.]+)`", line):
            module = m.group(1)
            assert module not in api, f"docs/plugins.md lists module {module} twice"
            api[module] = []
        elif m := re.match(r"\| `(\w+)` \|", line):
            assert module, f"docs/plugins.md: {line!r} before any module heading"
            api[module].append(m.group(1))
    return api


API = documented_api()


def test_the_promised_names_are_still_declared():
    for module, names in STABLE.items():
        assert module in API, f"docs/plugins.md no longer lists module {module}, which is promised stable"
        for name in names:
            assert name in API[module], f"{module}.{name} is promised stable but docs/plugins.md drops it"


@pytest.mark.parametrize("module", sorted(API))
def test_documented_names_are_the_module_all(module):
    mod = importlib.import_module(module)
    declared = getattr(mod, "__all__", None)
    assert declared is not None, f"{module} is public (docs/plugins.md) but has no __all__"
    assert len(declared) == len(set(declared)), f"{module}.__all__ repeats a name"
    assert not set(API[module]) - set(declared), f"{module}: documented but not in __all__: {set(API[module]) - set(declared)}"
    assert not set(declared) - set(API[module]), f"{module}: in __all__ but not documented: {set(declared) - set(API[module])}"
    for name in declared:
        assert hasattr(mod, name), f"{module}.__all__ names {name}, which the module lacks"


def hooks() -> dict[str, str]:
    return {name: f"{name}{inspect.signature(fn)}" for name, fn in vars(hookspecs).items()
            if name.startswith("colibri_") and callable(fn)}


@pytest.mark.parametrize("hook", sorted(hooks()))
def test_every_hook_is_documented_with_its_signature(hook):
    assert f"\n### {hooks()[hook]}\n" in GUIDE, f"docs/plugins.md lacks the heading ### {hooks()[hook]}"


def test_no_documented_hook_is_missing_from_hookspecs():
    headings = re.findall(r"^### (colibri_\w+\(.*\))$", GUIDE, re.M)
    assert headings and set(headings) == set(hooks().values())


def test_the_model_contract_is_explained():
    methods = [n for n, v in vars(MoEModel).items() if not n.startswith("_") and callable(getattr(MoEModel, n))]
    assert "forward" in methods and "moe" in methods
    for name in methods + ["__init__"]:
        assert f"| `{name}(" in GUIDE, f"MoEModel.{name} is not in docs/plugins.md's model contract table"
    for cls in (ContainerLayout, ExpertNames, Architecture):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in GUIDE, f"{cls.__name__}.{f.name} is not explained in docs/plugins.md"
    for member in ("length", "arrays()", "load_arrays(arrays)"):
        assert f"`{member}`" in GUIDE, f"the state protocol's {member} is not explained"


def test_the_conformance_suite_attributes_are_explained():
    from colibri_core.testing import ConformanceSuite

    attributes = [n for n, v in vars(ConformanceSuite).items()
                  if not n.startswith("_") and not callable(v) and not isinstance(v, (classmethod, staticmethod))]
    assert "hf_config" in attributes
    for name in attributes:
        assert f"| `{name}` |" in GUIDE, f"ConformanceSuite.{name} is not in docs/plugins.md's attribute table"


# ---- the guide's code is the example's code ---------------------------------------------------
def quoted() -> dict[str, list[str]]:
    """{path: [code blocks]} of every block preceded by <!-- file: path -->, in order."""
    found: dict[str, list[str]] = {}
    for path, body in re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)\n```", GUIDE, re.S):
        found.setdefault(path, []).append(body)
    return found


def example_files() -> list[str]:
    skip = {"build", "__pycache__"}
    return sorted(str(p.relative_to(REPO)) for p in EXAMPLE.rglob("*")
                  if p.is_file() and not skip & set(p.parts) and not any(s.endswith(".egg-info") for s in p.parts))


def test_every_example_file_is_quoted():
    assert example_files(), "the example plugin is missing"
    assert set(quoted()) == set(example_files())


@pytest.mark.parametrize("path", sorted(quoted()))
def test_guide_code_is_the_example_file(path):
    """The blocks quoting a file, in order, are the whole file (only blank lines between them)."""
    text = (REPO / path).read_text()
    blocks = quoted()[path]
    assert all(b.strip("\n") == b for b in blocks), f"{path}: a quoted block starts or ends with a blank line"
    if re.fullmatch(r"\n*".join(map(re.escape, blocks)) + r"\n", text):
        return
    at = 0  # say which block stops matching
    for i, b in enumerate(blocks):
        start = text.find(b, at)
        assert start >= 0 and not text[at:start].strip(), (
            f"docs/plugins.md block {i + 1} of {len(blocks)} quoting {path} is not the file's next piece")
        at = start + len(b)
    pytest.fail(f"{path} has more after the last block docs/plugins.md quotes")


# ---- plugins import only the public API -----------------------------------------------------------
def plugin_sources() -> list[Path]:
    """The example (code and tests) and the shipped plugins' code. The shipped plugins' own tests may
    use internals: they live in this repository and change with the core in one commit."""
    shipped = [p for p in (REPO / "plugins").glob("*/colibri_*/**/*.py")]
    example = [REPO / p for p in example_files() if p.endswith(".py")]
    return sorted(shipped + example)


@pytest.mark.parametrize("path", plugin_sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_plugins_import_only_the_public_api(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("colibri_core"):
                    assert alias.name in API, f"{path.name}: import {alias.name}: not a public module"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "colibri_core":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                ok = submodule in API or (node.module in API and alias.name in API[node.module])
                assert ok, (f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}: "
                            "not in the public API (docs/plugins.md)")
