#!/usr/bin/env python3
"""llama.cpp's own GGUF converter (convert_hf_to_gguf.py, its `conversion` package and the gguf-py
it imports), taken from the llama-cpp-python sdist and cached, for the tests that check colibri
reads the GGUFs llama.cpp writes (tests/test_gguf_llamacpp.py).

    tools/llama_converter.py            # prints the path of convert_hf_to_gguf.py
    tools/llama_converter.py --sdist    # prints the path of the cached sdist (.ci/run installs it)

The sdist (76 MB) is downloaded once with `pip download` from PyPI into
$COLIBRI_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/colibri)/llama-cpp-python-VERSION/ and kept there,
so that CI's `bench` extra builds llama.cpp from the same file; the three converter paths are
extracted beside it. A second call takes milliseconds. Any failure is one line on stderr, exit 1.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp writes the GGUFs under test
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/")  # what the converter imports


def cache_dir() -> Path:
    root = os.environ.get("COLIBRI_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colibri"
    return Path(root).expanduser() / f"llama-cpp-python-{VERSION}"


def sdist() -> Path:
    """The cached sdist, downloaded first if it is not there."""
    where = cache_dir()
    path = where / SDIST
    if not path.is_file():
        where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", str(where), f"llama-cpp-python=={VERSION}"], capture_output=True, text=True)
        if r.returncode != 0 or not path.is_file():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"llama_converter: pip download llama-cpp-python=={VERSION} failed: {last}")
    return path


def converter() -> Path:
    """convert_hf_to_gguf.py, extracted from the sdist once (atomically: a killed run leaves no half tree)."""
    where = cache_dir()
    script = where / "llama.cpp" / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    staging = where / "llama.cpp.partial"
    with tarfile.open(sdist()) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(tuple(VENDOR + p for p in PARTS))]
        for m in members:
            m.name = m.name[len(VENDOR):]
        tar.extractall(staging, members=members, filter="data")
    os.replace(staging, where / "llama.cpp")
    return script


if __name__ == "__main__":
    print(sdist() if sys.argv[1:] == ["--sdist"] else converter())
