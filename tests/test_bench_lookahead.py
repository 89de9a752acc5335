"""tools/bench_lookahead.py: its perfect lookahead must guess each layer's real routing, or its bound
is not one (the recorded routing indexed by forward pass: a pass more or less and it guesses another
token's experts)."""
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.system  # a tool's run

spec = importlib.util.spec_from_file_location("bench_lookahead", Path(__file__).parents[1] / "tools" / "bench_lookahead.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.filterwarnings("ignore")  # O_DIRECT refused by a test's filesystem: the page cache then
def test_the_perfect_lookahead_guesses_every_layer_right(tiny_model):
    routing = bench.record_routing(tiny_model, 2, 4, 6)
    perfect = bench.session(tiny_model, 2, "perfect", routing, 2, 4, 6)  # 2 of 8 experts cached a layer
    assert perfect["recall"] == 1.0
    assert bench.session(tiny_model, 2, "on", None, 2, 4, 6)["recall"] < 1.0  # the routers' own guesses miss some
