"""Shared fixtures: a tiny random OLMoE container built with NumPy alone (no oracle needed)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_core.convert import convert_checkpoint

COLIBRI = [sys.executable, "-m", "colibri_core"]


@pytest.fixture(autouse=True, scope="session")
def state_home(tmp_path_factory) -> Path:
    """The per-user state directory (colibri_core/statedir.py: sessions and routing history of models
    whose own directory is not written to) of this test run, never the real home's; the colibri
    processes the tests start inherit it."""
    d = tmp_path_factory.mktemp("state-home")
    os.environ["XDG_STATE_HOME"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from colibri_olmoe.demo import write_checkpoint, write_tokenizer

    d = tmp_path_factory.mktemp("tiny-hf")
    eos = write_tokenizer(d, ["the quick brown fox jumps over the lazy dog " * 20, "colibri streams experts"], 300)
    write_checkpoint(d, vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                     num_experts=8, num_experts_per_tok=2, eos_token_id=eos)
    return d


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("tiny") / "int4"
    convert_checkpoint(tiny_checkpoint, dst, "int4", progress=False)
    return dst


def colibri(*args, env=None, **kw) -> subprocess.CompletedProcess:
    """Run the `colibri` CLI in a subprocess."""
    return subprocess.run([*COLIBRI, *map(str, args)], capture_output=True, text=True, env=env, **kw)
