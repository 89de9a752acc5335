"""Only what cffi needs: compile csrc/ into colibri_core.kernels._colibri_kernels at install."""
from setuptools import setup

setup(cffi_modules=["colibri_core/kernels/_build.py:ffibuilder"])
