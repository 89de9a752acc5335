"""Build the bundled demo model deterministically: a random-weight OLMoE-architecture checkpoint with
a byte-level BPE tokenizer trained on this repository's own documentation, converted to int4.

    python tools/make_demo_model.py models/demo-olmoe

Random weights: it exercises every part of the engine (routing, experts streamed from disk,
caching) but writes no language. A trained demo model replaces it (see the README).
"""
import sys
import tempfile
from pathlib import Path

from colibri_core.convert import convert_checkpoint
from colibri_olmoe.demo import write_checkpoint, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def main(dst: str) -> None:
    texts = [p.read_text() for p in sorted(ROOT.glob("*.md"))] + [p.read_text() for p in sorted((ROOT / "colibri_core").rglob("*.py"))]
    with tempfile.TemporaryDirectory() as tmp:
        eos = write_tokenizer(tmp, texts, vocab_size=2048)
        write_checkpoint(tmp, vocab_size=2048, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_experts=16, num_experts_per_tok=2, eos_token_id=eos, seed=1234)
        convert_checkpoint(tmp, dst, "int4")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models/demo-olmoe")
