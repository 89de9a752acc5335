"""Streaming detokenisation (`tokenizer.StreamDecoder`): the deltas are what decoding the whole answer
again at every token gives, for the demo's and the tiny models' byte-level BPE and a Llama-style
tokenizer (Metaspace, byte fallback, a stripped first space), on text and on random ids (special
tokens, bytes that never make a character); and a 4,000-token answer costs linear work, counted as
the token strings its tokenizer's decoder is handed."""
import random

import pytest
from tokenizers import Tokenizer as HF
from tokenizers import decoders, models, normalizers

from colibri_core.demo import demo_model
from colibri_core.server.text import TextStream
from colibri_core.tokenizer import StreamDecoder, Tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog", "héllo wörld ✓ 🐦, naïve café — «ok»",
         "In the beginning God created the heaven and the earth.\n\n  And the earth was without form"]


def whole(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str] | None:
    """The deltas of decoding ids[:i] whole at every token, holding text that ends in an incomplete
    character, and what is left at the end: the definition the stream decoder meets. None where a
    decode does not start with the text shown before it (byte-fallback bytes that were a character
    alone and are not with the next ones): no stream can take back what it has shown."""
    deltas, shown = [], ""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i])
        if text.endswith("\ufffd"):
            deltas.append("")
            continue
        if not text.startswith(shown):
            return None
        deltas.append(text[len(shown):])
        shown = text
    return deltas, tokenizer.decode(ids)[len(shown):]


def llama_style() -> Tokenizer:
    """A SentencePiece-like tokenizer.json as Llama 2's: '▁' for spaces, unknown characters as
    <0xNN> byte tokens, the decoder dropping the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzITA.,!\n", "▁t", "he", "▁the", "▁a", "nd"]:
        vocab.setdefault(piece, len(vocab))
    hf = HF(models.BPE(vocab, [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("n", "d")], unk_token="<unk>",
                       byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    tokenizer = Tokenizer.__new__(Tokenizer)
    tokenizer.tok = hf
    return tokenizer


@pytest.fixture(params=["demo", "tiny", "llama-style"])
def tokenizer(request) -> Tokenizer:
    if request.param == "llama-style":
        return llama_style()
    model = demo_model() if request.param == "demo" else request.getfixturevalue("tiny_model")
    return Tokenizer.from_dir(model)


def stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = StreamDecoder(tokenizer)
    return [d.push(t) for t in ids], d.flush()


def test_the_deltas_are_those_of_the_whole_answer(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.tok.get_vocab_size(with_added_tokens=True)
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    cases.append([i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)[:-1]])  # ends mid-character
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(200)]  # specials, stray bytes
    for ids in cases:
        got = stream(tokenizer, ids)
        want = whole(tokenizer, ids)
        assert want is None or got == want, ids
    deltas, rest = stream(tokenizer, tokenizer.encode(TEXTS[1], add_special_tokens=False))
    assert "".join(deltas) + rest == TEXTS[1]


def test_bytes_that_stop_being_a_character_go_on_from_what_was_shown():
    """'H' as a byte-fallback token is shown; with a stray byte after it, decode turns both into
    U+FFFD (tokenizers' DecodeStream raises there): the stream goes on after the 'H' it showed."""
    tokenizer = llama_style()
    ids = [tokenizer.token_id("<0x48>"), tokenizer.token_id("<0xE2>"), tokenizer.token_id("I"), tokenizer.token_id("▁a")]
    assert stream(tokenizer, ids) == (["H", "", "\ufffdI", " a"], "")


def test_an_answer_cut_inside_a_character_ends_in_a_replacement_character():
    """The server's text stream: a character still incomplete when the answer ends is shown as U+FFFD."""
    tokenizer = Tokenizer.from_dir(demo_model())
    ids = tokenizer.encode("ok ✓", add_special_tokens=False)
    text = TextStream(tokenizer, [])
    assert "".join(text.push(t) for t in ids[:-1]) == "ok " and text.flush() == "\ufffd"


def test_a_long_answer_costs_linear_work():
    """4,000 tokens: the decoder is handed about as many token strings for the last thousand as for
    the first (decoding the whole answer at every token hands it ~3.5 million for the last)."""
    tokenizer = Tokenizer.from_dir(demo_model())
    handed = [0]

    class Counting:  # the demo's own decoder, counting the tokens it decodes
        def decode_chain(self, tokens):
            handed[0] += len(tokens)
            return [decoders.ByteLevel().decode(tokens)]

    text = " ".join(TEXTS) + " "
    ids = tokenizer.encode(text * (4000 // len(tokenizer.encode(text)) + 1), add_special_tokens=False)[:4000]
    tokenizer.tok.decoder = decoders.Decoder.custom(Counting())
    d, per_thousand, out = StreamDecoder(tokenizer), [], []
    for i in range(0, 4000, 1000):
        before = handed[0]
        out += [d.push(t) for t in ids[i:i + 1000]]
        per_thousand.append(handed[0] - before)
    assert max(per_thousand) <= 1.5 * per_thousand[0] and sum(per_thousand) <= 8 * 4000, per_thousand
    assert "".join(out) + d.flush() == tokenizer.decode(ids)
