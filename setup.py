"""Only what cffi needs: compile csrc/ into colibri_core.kernels._colibri_kernels at install.

The extension uses CPython's limited API (cffi builds it as `_colibri_kernels.abi3.so`), so the
wheel is tagged abi3 from the oldest Python colibri supports: one wheel per platform serves them all."""
from setuptools import setup

setup(cffi_modules=["colibri_core/kernels/_build.py:ffibuilder"],
      options={"bdist_wheel": {"py_limited_api": "cp310"}})
