"""cffi (API mode) builder: compiles csrc/*.c into ``colibri_core.kernels._colibri_kernels``.

setuptools runs this at install (``setup.py``: ``cffi_modules=[".../_build.py:ffibuilder"]``),
for ``pip install .`` and ``pip install -e .`` alike; the extension is ``_colibri_kernels.abi3.so``
(CPython's limited API). An editable install does not watch csrc/: after changing C, rerun
``pip install -e . --no-deps --no-build-isolation`` (or ``python setup.py build_ext --inplace``).

The declarations cffi sees are the HEADERS themselves, minus their preprocessor lines, so the
headers stay the one list of what C exports. No ``-march=native``: one build runs on any x86-64; SIMD
paths are chosen at run time inside the C code.
"""
import glob
import os
import sys

import cffi

HERE = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(ROOT, "csrc")
def _path(p: str) -> str:
    """`p` relative to the project root when building from there (setuptools runs from the root and
    prefers relative source paths; keeps absolute paths out of the build), else absolute."""
    return os.path.relpath(p, ROOT) if os.path.realpath(os.getcwd()) == ROOT else p


HEADERS = ("colibri.h", "io_pool.h", "deltanet.h", "decoder.h")  # the kernels; the expert store's I/O pool; Gated
# DeltaNet; a whole decoder layer


def _cdef() -> str:
    text = ""
    for name in HEADERS:
        with open(os.path.join(CSRC, name), encoding="utf-8") as f:
            text += "".join(line for line in f if not line.lstrip().startswith("#"))
    return text


if sys.platform == "win32":
    COMPILE_ARGS = ["/O2", "/fp:precise"]
    LIBRARIES = []
else:
    # -ffp-contract=off: no fused multiply-add, so each reduction rounds the same on every target.
    COMPILE_ARGS = ["-O3", "-std=c11", "-ffp-contract=off", "-pthread"]
    LIBRARIES = ["m", "pthread"]

ffibuilder = cffi.FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "colibri_core.kernels._colibri_kernels",
    "".join(f'#include "{name}"\n' for name in HEADERS),
    sources=[_path(p) for p in sorted(glob.glob(os.path.join(CSRC, "*.c")))],
    include_dirs=[_path(CSRC)],
    depends=[_path(p) for p in sorted(glob.glob(os.path.join(CSRC, "*.h")) + glob.glob(os.path.join(CSRC, "impl", "*.h")))],
    extra_compile_args=COMPILE_ARGS,
    libraries=LIBRARIES,
)
