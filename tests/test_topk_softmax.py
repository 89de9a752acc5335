"""`layers.router.TopKSoftmax` (GPT-OSS's routing): the top-k logits of x Wᵀ + b, softmax over those k,
as transformers' GptOssTopKRouter computes it; its lookahead is its routing."""
import numpy as np
import torch

from colibri_core.layers.router import TopKSoftmax
from colibri_core.quant import quantize


def test_top_k_then_softmax_matches_transformers_and_predicts_itself():
    rng = np.random.default_rng(0)
    T, E, H, k = 9, 12, 16, 3
    w, b = rng.standard_normal((E, H)).astype(np.float32), rng.standard_normal(E).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    router = TopKSoftmax(quantize(w, "f32"), k, bias=b)
    weights, ids = router.route(x, np.arange(T))
    logits = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b))
    top, want_ids = torch.topk(logits, k, dim=-1)
    assert np.array_equal(ids, want_ids.numpy()) and ids.dtype == np.int64
    assert np.allclose(weights, torch.softmax(top, dim=1).numpy(), rtol=1e-6, atol=1e-7)
    assert np.array_equal(router.predict(x, np.arange(T)), ids)
    plain = TopKSoftmax(quantize(w, "f32"), k)  # no bias: Mixtral's routing
    assert not np.array_equal(plain.route(x, np.arange(T))[1], ids)
