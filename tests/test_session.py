"""Session files (colibri_core/kv/session.py) without a model: every torn byte, refusals, the
append-only deltas; then the engine and `colibri chat --session` on the tiny OLMoE container."""
import json
import os
import shutil
from collections import Counter

import numpy as np
import pytest

from colibri_core import kv
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.kv.session import (
    DIRNAME, FORMAT_VERSION, HEAD, PersistentSession, SessionWarning, session_path,
)

IDENTITY = {"architecture": "toy", "fingerprint": "sha256:abc", "quant": "int4"}


class ToyState(kv.State):
    """A per-token cache (length, 3) and a fixed-size recurrent state (2, 2)."""

    def __init__(self):
        self.rows = np.zeros((0, 3), np.float32)
        self.rec = np.zeros((2, 2), np.float32)

    @property
    def length(self):
        return len(self.rows)

    def feed(self, ids):
        self.rows = np.concatenate([self.rows, np.asarray(ids, np.float32)[:, None] * [1, 2, 3]]).astype(np.float32)
        self.rec = self.rec * 0.5 + np.float32(sum(ids))

    def arrays(self):
        return {"rows": self.rows, "rec": self.rec}

    def load_arrays(self, arrays):
        self.rows, self.rec = arrays["rows"].copy(), arrays["rec"].copy()


class ToyModel:
    new_state = ToyState


def toy_session(tmp_path, name="s", identity=IDENTITY):
    return PersistentSession(ToyModel(), tmp_path, identity, name)


def turn(session, ids):
    session.state.feed(ids)
    session.ids = session.ids + list(ids)
    session.meta = {"turn": len(session.ids)}
    session.save()


def test_every_torn_byte_of_the_last_save_loads_the_turn_before(tmp_path):
    s = toy_session(tmp_path)
    turn(s, [1, 2, 3])
    size1 = s.file.path.stat().st_size
    turn(s, [4, 5])
    whole = s.file.path.read_bytes()
    rec_before = s.state.rec
    assert len(whole) > size1
    for n in range(size1, len(whole)):
        s.file.path.write_bytes(whole[:n])
        r = toy_session(tmp_path)
        assert r.ids == [1, 2, 3] and r.meta == {"turn": 3} and r.turns == 1, n
        assert np.array_equal(r.state.rows, np.array([[1, 2, 3], [2, 4, 6], [3, 6, 9]], np.float32))
        assert (r.notice is None) == (n == size1), (n, r.notice)
    # the whole file: the second turn, its fixed-size state written whole, the cache as new rows
    s.file.path.write_bytes(whole)
    r = toy_session(tmp_path)
    assert r.ids == [1, 2, 3, 4, 5] and np.array_equal(r.state.rec, rec_before) and r.notice is None
    # resuming after a torn save appends after the last whole turn (the torn bytes are dropped)
    s.file.path.write_bytes(whole[:-5])
    r = toy_session(tmp_path)
    turn(r, [9])
    again = toy_session(tmp_path)
    assert again.ids == [1, 2, 3, 9] and again.turns == 2 and again.notice is None


def test_turns_are_appended_as_deltas(tmp_path):
    s = toy_session(tmp_path)
    turn(s, list(range(100)))
    size1 = s.file.path.stat().st_size
    turn(s, [7])
    assert s.file.path.stat().st_size - size1 < 1000, "the second turn rewrote the whole cache"
    s.save()  # nothing changed: nothing written
    size2 = s.file.path.stat().st_size
    s.save()
    assert s.file.path.stat().st_size == size2
    s.reset()  # a new conversation starts the file over (renamed into place)
    turn(s, [3])
    assert s.file.path.stat().st_size < size1 and not s.file.path.with_name("s.coli_session.tmp").exists()
    r = toy_session(tmp_path)
    assert r.ids == [3] and r.state.rows.shape == (1, 3)


def test_refused_files_are_moved_aside_and_start_fresh(tmp_path):
    s = toy_session(tmp_path)
    turn(s, [1, 2])
    path, whole = s.file.path, s.file.path.read_bytes()
    cases = {
        "another model": lambda: toy_session(tmp_path, identity={**IDENTITY, "quant": "int8"}),
        "format version": lambda: (path.write_bytes(HEAD.pack(b"COLISESS", FORMAT_VERSION + 1, 0) + whole[HEAD.size:]),
                                   toy_session(tmp_path))[1],
        "not a colibri session": lambda: (path.write_bytes(b"garbage" * 10), toy_session(tmp_path))[1],
        "damaged": lambda: (path.write_bytes(whole[:HEAD.size + 3] + b"X" + whole[HEAD.size + 4:]), toy_session(tmp_path))[1],
    }
    for why, reopen in cases.items():
        path.write_bytes(whole)
        r = reopen()
        assert r.turns == 0 and r.ids == [] and r.state.length == 0, why
        assert why in r.notice and "moved it to s.coli_session.bad" in r.notice and len(r.notice.splitlines()) == 1
        assert not path.exists() and path.with_name("s.coli_session.bad").is_file()
        path.with_name("s.coli_session.bad").unlink()
    path.write_bytes(b"garbage" * 10)  # a second refused file beside the first: both kept
    toy_session(tmp_path)
    path.write_bytes(b"rubbish" * 10)
    r = toy_session(tmp_path)
    assert "moved it to s.coli_session.bad1" in r.notice, r.notice
    assert path.with_name("s.coli_session.bad").read_bytes() == b"garbage" * 10
    assert path.with_name("s.coli_session.bad1").read_bytes() == b"rubbish" * 10


def three_turns(tmp_path):
    """A session of three turns: its file's bytes, where each turn's record ends (0: the header's
    end) and the session (ids, rows, rec, meta) after each turn (0: none)."""
    s = toy_session(tmp_path)
    ends, after = [], [([], None, None, {})]
    for ids in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        turn(s, ids)
        ends.append(s.file.path.stat().st_size)
        after.append((list(s.ids), s.state.rows.copy(), s.state.rec.copy(), s.meta))
    whole = s.file.path.read_bytes()
    return whole, [HEAD.size + HEAD.unpack_from(whole)[2] + 4, *ends], after


def set_aside(path):
    """The files session file `path`'s damage was kept in."""
    return sorted(p for p in path.parent.iterdir() if p.name.startswith((path.name + ".bad", path.name + ".torn")))


@pytest.mark.parametrize("damage", ["a flipped bit", "a cut"])
def test_no_whole_turn_is_lost_to_damage_at_any_byte(tmp_path, monkeypatch, damage):
    """One bit flipped at every byte of a 3-turn session file (bit i % 8 of byte i: each bit position
    once over a record's 8-byte length), or the file cut at every byte: the session resumes at
    the last whole turn before the damage, every byte of the damaged file is kept (a whole copy in
    .bad, or the file's whole turns plus the dropped bytes in .torn), named in a one-line notice,
    and they still are after the next save. Damage with a whole turn after it is never taken for an
    unfinished save. Every flip is noticed: the header and each record's payload are under a crc32
    (which finds every single-bit error), and a flip in a record's own header (magic, length,
    checksum) breaks that record."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # what is kept, not when it is durable: 3x faster
    whole, ends, after = three_turns(tmp_path)
    path = session_path(tmp_path, "s")
    seen = Counter()
    for i in range(len(whole)):
        damaged = bytes([*whole[:i], whole[i] ^ 1 << i % 8, *whole[i + 1:]]) if damage == "a flipped bit" else whole[:i]
        k = sum(end <= i for end in ends[1:])  # the whole turns before byte i
        path.write_bytes(damaged)
        r = toy_session(tmp_path)
        ids, rows, rec, meta = after[k]
        assert r.turns == k and r.ids == ids and r.meta == meta, (i, r.notice)
        assert np.array_equal(r.state.rows, rows) and np.array_equal(r.state.rec, rec) if k else r.state.length == 0
        aside = set_aside(path)
        if damage == "a cut" and i in ends:  # a cut between turns: a whole file of k turns (or none)
            assert r.notice is None and not aside, (i, r.notice)
            continue
        assert r.notice and len(r.notice.splitlines()) == 1 and len(aside) == 1 and aside[0].name in r.notice, \
            (i, r.notice, aside)
        kept, torn = aside[0].read_bytes(), aside[0].name.endswith(".torn")
        if i < ends[0] or (damage == "a flipped bit" and k < 2):  # the header, or a whole turn after the damage
            assert not torn, (i, r.notice)
        elif damage == "a cut":
            assert torn, (i, r.notice)
        assert ("unfinished" in r.notice) == torn, (i, r.notice)

        def every_byte_kept():
            return (path.read_bytes()[:ends[k]] + kept if torn else kept) == damaged

        assert every_byte_kept(), (i, r.notice)
        turn(r, [99])
        again = toy_session(tmp_path)
        assert again.notice is None and again.turns == k + 1 and again.ids == ids + [99], (i, again.notice)
        assert set_aside(path) == aside and aside[0].read_bytes() == kept and every_byte_kept(), i
        seen["torn" if torn else "bad"] += 1
        aside[0].unlink()
    assert seen["bad"] and seen["torn"], seen


def test_a_flipped_bit_in_a_middle_turns_length_keeps_the_turns_after_it(tmp_path):
    """A flipped bit in turn 2's length makes its record run past the end of the file, as an
    unfinished save's does; but turn 3 after it is whole, so this is damage: the file is kept whole,
    the session resumes after turn 1, and the next save deletes nothing."""
    whole, ends, after = three_turns(tmp_path)
    path = session_path(tmp_path, "s")
    damaged = bytearray(whole)
    damaged[ends[1] + 4 + 3] ^= 0x10  # the length's fourth byte: 2**28 bytes more
    path.write_bytes(bytes(damaged))
    r = toy_session(tmp_path)
    assert r.notice == (f"session s: the saved file is damaged at byte {ends[1]} (the record of turn 2 runs past "
                        "the end of the file) and holds whole turns after it; kept it whole as s.coli_session.bad; "
                        "resuming after turn 1")
    assert r.turns == 1 and r.ids == after[1][0] and path.read_bytes() == whole[:ends[1]]
    turn(r, [99])
    assert toy_session(tmp_path).ids == [1, 2, 3, 99]
    assert path.with_name("s.coli_session.bad").read_bytes() == bytes(damaged)


def test_session_names(tmp_path):
    assert session_path(tmp_path, "chat-1.a") == tmp_path / DIRNAME / "chat-1.a.coli_session"
    for bad in ("", "../x", ".hidden", "a/b", "x" * 200):
        with pytest.raises(ColibriError, match="bad session name"):
            session_path(tmp_path, bad)


def test_engine_sessions_write_only_when_used(tiny_model, tmp_path):
    """Opening a session writes nothing; the first turn creates MODEL/.sessions/NAME.coli_session;
    generate(session=NAME) continues it; a refused file warns once (SessionWarning)."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    with load(model) as engine:
        s = engine.open_session("a")
        assert not (model / DIRNAME).exists()
        first = engine.generate([5, 6, 7], 4, stop_ids=(), session="a")
        assert engine.open_session("a") is s and s.file.path.is_file() and s.turns == 1
    ident = json.loads(s.file.path.read_bytes()[HEAD.size:HEAD.size + HEAD.unpack_from(s.file.path.read_bytes())[2]])
    assert ident["architecture"] == "olmoe" and ident["quant"] == "int4" and ident["fingerprint"].startswith("sha256:")
    s.file.path.write_bytes(s.file.path.read_bytes()[:HEAD.size] + b"\0" * 40)
    with load(model) as engine, pytest.warns(SessionWarning, match="damaged"):
        assert engine.open_session("a").ids == []
    with load(model) as engine:
        assert engine.generate([5, 6, 7], 4, stop_ids=(), session="a") == first


def test_chat_session_resumes_the_conversation(tiny_model, tmp_path):
    """`colibri chat --session NAME`: a second run remembers the first run's messages and continues
    with exactly the answer an uninterrupted chat gives."""
    from typer.testing import CliRunner

    from colibri_core.cli import app

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    args = ["chat", "--model", str(model), "--temperature", "0", "--max-tokens", "5"]

    def chat(lines, *extra):  # each call loads the model afresh, as a restarted process does
        r = CliRunner().invoke(app, args + list(extra), input="".join(x + "\n" for x in lines))
        assert r.exit_code == 0, (r.output, r.exception)
        return r

    def answers(r):
        return [line for line in r.stdout.replace("> ", "").splitlines() if line]

    both = chat(["the quick", "brown fox"])
    first = chat(["the quick"], "--session", "c")
    second = chat(["brown fox"], "--session", "c")
    assert "resumed session c: 2 messages" in second.stderr
    assert answers(first) + answers(second) == answers(both) and len(answers(both)) == 2
    assert sorted(os.listdir(model / DIRNAME)) == ["c.coli_session", "c.coli_session.lock"]  # the lock: empty


def test_an_unwritable_model_directory_is_one_clear_error(tmp_path):
    s = toy_session(tmp_path)
    (tmp_path / DIRNAME).write_text("not a directory")  # the sessions directory cannot be created
    s.state.feed([1])
    s.ids = [1]
    with pytest.raises(ColibriError, match="cannot save session s in"):
        s.save()


def test_failed_forward_leaves_session_intact(tmp_path):
    """A read error or Ctrl-C in the middle of a forward on the demo model: the session is as it was,
    continuing it gives the uninterrupted run's tokens, a persistent session never saves the failed turn."""
    from colibri_core.cli import DEFAULT_MODEL
    from colibri_core.testing.sessions import check_failed_forward
    from colibri_core.tokenizer import Tokenizer

    vocab = json.loads((DEFAULT_MODEL / "config.json").read_text())["vocab_size"]
    prompt = Tokenizer.from_dir(DEFAULT_MODEL).encode("And the LORD said unto Moses")
    check_failed_forward(DEFAULT_MODEL, tmp_path, prompt, vocab)


def _chat(model, lines, *extra):
    from typer.testing import CliRunner

    from colibri_core.cli import app

    r = CliRunner().invoke(app, ["chat", "--model", str(model), "--temperature", "0", "--max-tokens", "5", *extra],
                           input="".join(x + "\n" for x in lines))
    assert r.exit_code == 0, (r.output, r.exception)
    return r


def _messages(model, name):
    from colibri_core.kv.session import SessionFile

    path = session_path(model, name)
    data = path.read_bytes()
    saved = SessionFile(path, json.loads(data[HEAD.size: HEAD.size + HEAD.unpack_from(data)[2]])).load()
    return saved.meta["messages"]


def test_chat_ctrl_c_stops_the_answer_not_the_chat(tiny_model, tmp_path, monkeypatch):
    """Ctrl-C while an answer streams: the chat goes on; the question and its partial answer are
    forgotten (not saved), and the next question is answered as in a fresh chat."""
    from colibri_core.engine import Engine

    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    fresh = _chat(model, ["brown fox"]).stdout.split("> ")[-2]
    real, calls = Engine.stream, []

    def stream(self, *args, **kw):
        calls.append(1)
        tokens = real(self, *args, **kw)
        if len(calls) == 1:
            yield next(tokens)
            tokens.close()
            raise KeyboardInterrupt
        yield from tokens

    monkeypatch.setattr(Engine, "stream", stream)
    r = _chat(model, ["the quick", "brown fox"], "--session", "c")
    assert "(interrupted" in r.stderr and r.stdout.split("> ")[-2] == fresh
    assert [(m["role"], m["content"]) for m in _messages(model, "c")][0] == ("user", "brown fox")
    assert len(_messages(model, "c")) == 2


def test_chat_resumes_an_old_file_ending_on_a_question_at_the_turn_before(tiny_model, tmp_path):
    """A file written by a colibri that saved a turn's state and messages as two records, killed
    between them: its conversation ends on a question without its answer. The chat drops that
    question with a note and goes on as from the turn before (here: a fresh conversation)."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    fresh = _chat(model, ["brown fox"]).stdout.split("> ")[-2]
    with load(model) as engine:
        s = engine.open_session("old")
        s.meta = {"messages": [{"role": "user", "content": "the quick"}]}
        engine.generate([5, 6, 7], 4, stop_ids=(), session=s)  # saved: the state and the question alone
    r = _chat(model, ["brown fox"], "--session", "old")
    assert "the last question was saved without its answer" in r.stderr and "resumed" not in r.stderr
    assert r.stdout.split("> ")[-2] == fresh
    assert [m["role"] for m in _messages(model, "old")] == ["user", "assistant"]


def test_notices_count_turns_not_records(tmp_path):
    """Turns are numbered in their records: a conversation started over is turn 0, and a torn save
    is reported against the last whole turn."""
    s = toy_session(tmp_path)
    turn(s, [1, 2])
    turn(s, [3])
    assert s.turns == 2
    s.reset()
    s.save()  # the conversation started over: turn 0, no tokens
    assert toy_session(tmp_path).turns == 0 and toy_session(tmp_path).ids == []
    turn(s, [4, 5])
    turn(s, [6])
    whole = s.file.path.read_bytes()
    s.file.path.write_bytes(whole[:-3])
    r = toy_session(tmp_path)
    assert r.turns == 1 and r.ids == [4, 5] and "resuming after turn 1" in r.notice


def test_chat_keeps_special_tokens_typed_in_a_message_as_text(tiny_model, tmp_path, monkeypatch):
    """`<|endoftext|>` typed in `colibri chat` is text, not the end-of-text token the template
    writes after each message (which would end the user's turn early)."""
    from colibri_core.engine import Engine
    from colibri_core.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(tiny_model).token_id("<|endoftext|>")
    real, prompts = Engine.stream, []

    def stream(self, prompt_ids, *args, **kw):
        prompts.append(list(prompt_ids))
        return real(self, prompt_ids, *args, **kw)

    monkeypatch.setattr(Engine, "stream", stream)
    model = tmp_path / "m"  # a copy: the chat writes its routing history beside the model
    shutil.copytree(tiny_model, model)
    _chat(model, ["the quick <|endoftext|> fox", "the quick fox"])
    assert prompts[0].count(eos) == 1 and prompts[1].count(eos) == 3  # the template's own, one per message


def test_a_session_is_open_in_one_engine_at_a_time(tiny_model, tmp_path):
    """Two engines appending to one session file tore it (every turn lost at the next open): the
    second one to open it is refused until the first is closed; another process likewise."""
    import shutil
    import subprocess
    import sys

    from colibri_core import load
    from colibri_core.errors import ColibriError

    m = tmp_path / "m"
    shutil.copytree(tiny_model, m)
    a, b = load(m, usage=False), load(m, usage=False)
    try:
        a.generate([5, 6, 7], 3, session="shared", stop_ids=())
        with pytest.raises(ColibriError, match="session shared is open in another engine"):
            b.open_session("shared")
        code = f"from colibri_core import load; load({str(m)!r}, usage=False).open_session('shared')"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 1 and "is open in another engine or process" in r.stderr
        a.close()
        assert b.open_session("shared").ids[:3] == [5, 6, 7]
    finally:
        a.close()
        b.close()
