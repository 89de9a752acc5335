"""The tensor table (colibri_core/tensors.py): each tensor declared once, the layout and the resident
shapes derived from it, and a matrix declared the wrong way round refused by its axes' names even
where H = I makes it square."""
import pytest

from colibri_core.errors import ColibriError
from colibri_core.tensors import Dim, Experts, Tensor, TensorTable

H, I, E = Dim("H", 16), Dim("I", 16), Dim("E", 4)  # H = I: every expert matrix is square
L = "model.layers.{layer}."


def experts(**kw) -> Experts:
    names = dict(router=Tensor(L + "mlp.gate.weight", (E, H)), gate=Tensor(L + "e.{expert}.gate", (I, H)),
                 up=Tensor(L + "e.{expert}.up", (I, H)), down=Tensor(L + "e.{expert}.down", (H, I)))
    return Experts(**{"layers": range(2), "n": E, "hidden": H, "intermediate": I, "top_k": 2, **names, **kw})


def table(**kw) -> TensorTable:
    return TensorTable(resident=dict(embed=Tensor("embed", (32, H)), norm=Tensor(L + "norm", (H,), layers=range(2)),
                                     proj=Tensor(L + "proj", (H, H), layers=range(2), f32=True, aliases=(L + "old",)),
                                     head=Tensor("head", (32, H))), experts=experts(**kw))


def test_layout_and_shapes_derive_from_the_table():
    t = table()
    assert t.resident_shapes() == {"embed": (32, 16), L.format(layer=0) + "norm": (16,), L.format(layer=0) + "proj": (16, 16),
                                   L.format(layer=0) + "mlp.gate.weight": (4, 16), L.format(layer=1) + "norm": (16,),
                                   L.format(layer=1) + "proj": (16, 16), L.format(layer=1) + "mlp.gate.weight": (4, 16),
                                   "head": (32, 16)}
    layout = t.layout()
    assert layout.resident == tuple(t.resident_shapes())
    assert [n for n in layout.resident if layout.stays_f32(n, 2)] == [
        "model.layers.0.proj", "model.layers.0.mlp.gate.weight", "model.layers.1.proj", "model.layers.1.mlp.gate.weight"]
    assert layout.sources("model.layers.1.proj") == [("model.layers.1.proj", None, None), ("model.layers.1.old", None, None)]
    assert layout.experts.per_expert["down"] == L + "e.{expert}.down" and not layout.experts.fused_transposed
    assert (layout.n_experts, layout.hidden, layout.intermediate, layout.moe_layers) == (4, 16, 16, (0, 1))


def test_take_reads_each_layer_by_key_and_takes_only_what_is_read():
    taken = []
    t = table()
    w = t.take(lambda name: taken.append(name) or name, 1)
    assert "proj" in w and "embed" not in w and not taken  # asking takes nothing
    assert w["proj"] == "model.layers.1.proj" and taken == ["model.layers.1.proj"]
    assert dict(w) == {"norm": "model.layers.1.norm", "proj": "model.layers.1.proj", "router": "model.layers.1.mlp.gate.weight"}
    assert dict(t.take(lambda name: name)) == {"embed": "embed", "head": "head"}


@pytest.mark.parametrize("role, shape", [("gate", (H, I)), ("up", (H, I)), ("down", (I, H))])
def test_a_square_per_expert_matrix_declared_the_wrong_way_round_is_refused(role, shape):
    assert int(H) == int(I)  # the shapes alone are equal: only the axes' names tell
    with pytest.raises(ColibriError, match=rf"experts' {role} .* is declared \({shape[0].name}, {shape[1].name}\), must be"):
        experts(**{role: Tensor(L + f"e.{{expert}}.{role}", shape)})


def test_a_square_fused_down_in_the_other_orientation_than_gate_up_is_refused():
    fused = dict(gate=None, up=None, down=None, gate_up=Tensor(L + "gate_up", (E, 2 * I, H)))
    assert experts(**fused, down_fused=Tensor(L + "down", (E, H, I))).names().fused_transposed is False
    assert experts(**{**fused, "gate_up": Tensor(L + "gate_up", (E, H, 2 * I))},
                   down_fused=Tensor(L + "down", (E, I, H))).names().fused_transposed is True
    with pytest.raises(ColibriError, match="different orientations"):
        experts(**fused, down_fused=Tensor(L + "down", (E, I, H)))


def test_a_square_router_declared_the_wrong_way_round_is_refused():
    """The router, a resident matrix whose role the table knows: (E, H), rows the experts."""
    square = Dim("E", 16)
    t = TensorTable(resident={}, experts=experts(n=square, router=Tensor(L + "mlp.gate.weight", (square, H))))
    assert t.resident_shapes()["model.layers.0.mlp.gate.weight"] == (16, 16)
    with pytest.raises(ColibriError, match=r"router .* is declared \(H, E\), must be \(E, H\)"):
        experts(n=square, router=Tensor(L + "mlp.gate.weight", (H, square)))


def test_a_size_that_is_no_integer_is_refused_not_truncated():
    with pytest.raises(ColibriError, match="gives 64.5 as the size H: it must be an integer"):
        Dim("H", 64.5)


def test_unnamed_expert_axes_are_refused():
    with pytest.raises(ColibriError, match="name every axis with a Dim"):
        experts(down=Tensor(L + "e.{expert}.down", (16, 16)))


def test_a_per_layer_name_needs_its_layers():
    with pytest.raises(ColibriError, match="needs `layers`"):
        TensorTable(resident={"x": Tensor(L + "x", (H,))}, experts=experts())


def test_the_guides_blocks_from_a_shipped_plugin_are_its_text():
    """docs/plugins.md quotes plugins/gpt_oss for the expert biases (Qwen3-MoE has none): each block
    marked <!-- from: path --> is a piece of that file, verbatim."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    blocks = re.findall(r"<!-- from: (\S+) -->\n```\w*\n(.*?)\n```", (repo / "docs" / "plugins.md").read_text(), re.S)
    assert blocks, "docs/plugins.md quotes no shipped plugin"
    for path, body in blocks:
        assert body in (repo / path).read_text(), f"docs/plugins.md quotes {path}, which no longer holds:\n{body[:200]}"
