"""colibri: run Mixture-of-Experts models larger than RAM, with outputs that never depend on placement.

The stable Python API:

    engine = colibri_core.load(model_dir, ram="4GB")        # or cache_slots=N per layer
    new_ids = engine.generate(prompt_ids, max_new_tokens=32)
    logits = engine.logits(ids)                             # float32 (len(ids), vocab)
    engine.stats(); engine.close()
    tensors = colibri_core.dequantize(model_dir)            # what the oracle is loaded with

Attributes are imported lazily so that `colibri plugins` and other light commands import no
numerical code.
"""
__version__ = "0.1.0"

__all__ = ["load", "dequantize", "Engine", "ColibriError", "__version__"]


def __getattr__(name):
    if name in ("load", "Engine"):
        from . import engine

        return getattr(engine, name)
    if name == "dequantize":
        from .container import dequantize

        return dequantize
    if name == "ColibriError":
        from .errors import ColibriError

        return ColibriError
    raise AttributeError(f"module 'colibri_core' has no attribute {name!r}")
