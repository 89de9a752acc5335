"""`ExpertNames`' fused layouts: the default (E, 2I, H) gate rows first, and the transposed and
interleaved forms a plugin declares (GPT-OSS: (E, H, 2I) gate and up alternating, (E, I, H)): each
expert's gate, up and down come out as [I, H], [I, H], [H, I] and go back to the same bytes."""
import numpy as np
import pytest

from colibri_core.layout import ExpertNames

E, H, I = 3, 6, 4


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_split_and_join_are_inverse_and_pick_the_declared_rows(transposed, interleaved):
    names = ExpertNames({}, "gu", "d", fused_transposed=transposed, gate_up_interleaved=interleaved)
    rng = np.random.default_rng(0)
    gate, up, down = (rng.standard_normal(s).astype(np.float32) for s in ((E, I, H), (E, I, H), (E, H, I)))
    gu = np.empty((E, 2 * I, H), np.float32)  # the default form, then the declared one built by hand
    if interleaved:
        gu[:, 0::2], gu[:, 1::2] = gate, up
    else:
        gu[:, :I], gu[:, I:] = gate, up
    dn = down
    if transposed:
        gu, dn = gu.transpose(0, 2, 1), dn.transpose(0, 2, 1)
    assert (gu.shape, dn.shape) == names.fused_shapes(E, H, I)
    for e in range(E):
        g, u, d = names.split_fused(gu[e], dn[e])
        assert all(m.flags.c_contiguous for m in (g, u, d))
        assert np.array_equal(g, gate[e]) and np.array_equal(u, up[e]) and np.array_equal(d, down[e])
        back = names.join_fused(g, u, d)
        assert all(m.flags.c_contiguous for m in back)  # written to safetensors as they are
        assert np.array_equal(back[0], gu[e]) and np.array_equal(back[1], dn[e])


def test_one_orientation_for_both_tensors_keeps_a_square_down_unambiguous():
    """H = I: down is square either way, gate_up is not, so the declared orientation is checkable."""
    plain, turned = ExpertNames({}), ExpertNames({}, fused_transposed=True)
    (gu0, d0), (gu1, d1) = plain.fused_shapes(E, 4, 4), turned.fused_shapes(E, 4, 4)
    assert d0 == d1 and gu0 != gu1
