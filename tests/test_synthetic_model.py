"""tools/make_synthetic_olmoe.py, the benchmark model's generator (the full container is 3.6 GB:
a benchmark's business; here only the weights it draws)."""
import importlib.util
from pathlib import Path

import numpy as np

from colibri_core import quant

spec = importlib.util.spec_from_file_location("make_synthetic_olmoe",
                                              Path(__file__).parents[1] / "tools" / "make_synthetic_olmoe.py")
synth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(synth)


def test_random_int4_weights_have_mean_zero_and_the_asked_std():
    """A weight mean off zero makes every matrix add one offset to all its outputs, which grows
    layer after layer until every token routes the same (the bug this guards against)."""
    w = quant.dequantize(synth.int4_random(np.random.default_rng(0), 512, 1024, std=0.02))  # (512, 1024)
    assert abs(w.mean()) < 0.02 / 100
    assert abs(w.std() - 0.02) < 0.02 * 0.02
