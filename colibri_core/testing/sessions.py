"""Session checks every architecture must pass (used by the conformance suite and by the core's
tests): a resumed session continues with exactly the tokens of an uninterrupted run and re-prefills
only the new tokens, a save torn at any byte is dropped cleanly, a `kill -9` in the middle of a
save loses only that turn, and a forward that fails midway (a read error, Ctrl-C) leaves the
session as it was."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..engine import load
from ..errors import ColibriError
from ..kv.session import SessionFile, SessionWarning, session_path
from ..store.io import IOPool

NEW_TOKENS = 6


def _turns(prompt: list[int], vocab: int) -> tuple[list[int], list[int]]:
    """The first user turn, and what the second adds after the first answer."""
    extra = [(7 * t + 3) % vocab for t in range(len(prompt) // 2 + 2)]
    return list(prompt), extra


def uninterrupted(model_dir: Path, prompt: list[int], vocab: int) -> tuple[list[int], list[int]]:
    """Two turns in one in-memory session: (answer 1, answer 2)."""
    first, extra = _turns(prompt, vocab)
    with load(model_dir) as engine:
        s = engine.new_session()
        a1 = engine.generate(first, NEW_TOKENS, stop_ids=(), session=s)
        a2 = engine.generate(first + a1 + extra, NEW_TOKENS, stop_ids=(), session=s)
    return a1, a2


def resume_and_continue(model_dir: Path, prompt: list[int], vocab: int, a1: list[int]) -> tuple[list[int], int, object]:
    """Reopen session "s" (one saved turn expected); run turn 2. Returns (answer 2, tokens the
    model was fed for the turn's prompt, the session)."""
    first, extra = _turns(prompt, vocab)
    with load(model_dir) as engine:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SessionWarning)  # checked through session.notice
            session = engine.open_session("s")
        fed = []
        forward = engine.model.forward
        engine.model.forward = lambda ids, state, last_only=False: (fed.append(len(ids)), forward(ids, state, last_only))[1]
        a2 = engine.generate(first + a1 + extra, NEW_TOKENS, stop_ids=(), session=session)
    return a2, fed[0], session


def check_torn_saves(model_dir: Path, work: Path, prompt: list[int], vocab: int) -> None:
    """Save two turns; cut the file inside the second turn's record (~100 places): each cut loads as
    exactly the first turn; resuming from a few cuts continues token-identically, prefilling only
    the new tokens. Also: a file of another model, and one damaged before its last turn, are
    refused (moved aside) and the session starts fresh."""
    a1_ref, a2_ref = uninterrupted(model_dir, prompt, vocab)
    model = work / "model"
    shutil.copytree(model_dir, model)
    first, extra = _turns(prompt, vocab)
    path = session_path(model, "s")
    with load(model) as engine:
        assert engine.generate(first, NEW_TOKENS, stop_ids=(), session="s") == a1_ref, "saving changed the tokens"
        size1 = path.stat().st_size
        turn1 = engine.open_session("s").file.identity
        assert engine.generate(first + a1_ref + extra, NEW_TOKENS, stop_ids=(), session="s") == a2_ref
    whole = path.read_bytes()
    assert len(whole) > size1, "the second turn was not saved"
    ref = SessionFile(work / "turn1.coli_session", turn1)
    (work / "turn1.coli_session").write_bytes(whole[:size1])
    ref = ref.load()
    assert ref is not None and ref.turns == 1 and ref.ids == first + a1_ref[:-1]
    cut = work / "cut.coli_session"
    # every byte of the record's header and its first JSON bytes, 24 cuts spread over the rest, the
    # last bytes (tests/test_session.py cuts a small state's save at every byte)
    offsets = {*range(size1, size1 + 64), *np.linspace(size1, len(whole) - 1, 24).astype(int), *range(len(whole) - 8, len(whole))}
    for n in sorted(o for o in offsets if size1 <= o < len(whole)):
        cut.write_bytes(whole[:n])
        f = SessionFile(cut, turn1)
        got = f.load()
        assert got is not None and got.turns == 1 and got.ids == ref.ids, f"a save cut at byte {n} did not load as turn 1"
        assert got.arrays.keys() == ref.arrays.keys()
        assert all(np.array_equal(got.arrays[k], ref.arrays[k]) for k in ref.arrays), f"cut at byte {n}: state differs"
        assert (f.notice is None) == (n == size1), f"cut at byte {n}: notice {f.notice!r}"
    for n in sorted({size1 + 1, (size1 + len(whole)) // 2, len(whole) - 1}):
        path.write_bytes(whole[:n])
        a2, fed, session = resume_and_continue(model, prompt, vocab, a1_ref)
        assert session.turns >= 2 and "unfinished" in (session.notice or "")
        assert a2 == a2_ref, f"resumed after a save cut at byte {n}: tokens differ from the uninterrupted run"
        assert fed == len(extra) + 1, f"resuming re-prefilled {fed} tokens, expected only the {len(extra) + 1} new ones"
    # another model: refused, moved aside, fresh start
    path.write_bytes(whole)
    other = SessionFile(path, {**turn1, "fingerprint": "sha256:another"})
    assert other.load() is None and "another model" in other.notice and not path.exists()
    assert (path.parent / (path.name + ".bad")).read_bytes() == whole
    # damaged before the last turn: refused whole (never half-used)
    damaged = bytearray(whole)
    damaged[size1 - 3] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with load(model) as engine, warnings.catch_warnings():
        warnings.simplefilter("ignore", SessionWarning)
        s = engine.open_session("s")
    assert s.turns == 0 and s.ids == [] and "damaged" in s.notice


# Python a child process runs first: after `pause_saves(seconds, fraction)` every session record it
# writes (b"TURN"…) stops once `fraction` of it is on disk (flushed, fsync'd), says so on stderr and
# sleeps `seconds`, so that a `kill -9` lands inside the save at that byte. It wraps the `open` that
# colibri_core.kv.session calls: the engine itself has no such hook.
PAUSE_SAVES = textwrap.dedent("""
    import os, sys, time
    import colibri_core.kv.session

    class _PausedFile:
        def __init__(self, f, seconds, fraction):
            self.f, self.seconds, self.fraction = f, seconds, fraction
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.f.__exit__(*exc)
        def write(self, data):
            if data[:4] != b"TURN":
                return self.f.write(data)
            cut = int(len(data) * self.fraction)
            self.f.write(data[:cut])
            self.f.flush()
            os.fsync(self.f.fileno())
            print("colibri: session save paused", file=sys.stderr, flush=True)
            time.sleep(self.seconds)
            return self.f.write(data[cut:])

    def pause_saves(seconds, fraction=0.5):
        colibri_core.kv.session.open = lambda *args, **kw: _PausedFile(open(*args, **kw), seconds, fraction)
""")

_CHILD = textwrap.dedent("""
    import sys
    from colibri_core.engine import load
    first, a1, extra, n = {first!r}, {a1!r}, {extra!r}, {n}
    with load(sys.argv[1]) as engine:
        assert engine.generate(first, n, stop_ids=(), session="s") == a1
        pause_saves(60)
        engine.generate(first + a1 + extra, n, stop_ids=(), session="s")
    print("the save was not interrupted", file=sys.stderr)
""")


def check_kill_during_save(model_dir: Path, work: Path, prompt: list[int], vocab: int) -> None:
    """`kill -9` a process in the middle of saving turn 2 (paused after half the record is on disk):
    a restart resumes from turn 1 and continues with exactly the uninterrupted run's tokens."""
    a1_ref, a2_ref = uninterrupted(model_dir, prompt, vocab)
    model = work / "model-kill"
    shutil.copytree(model_dir, model)
    first, extra = _turns(prompt, vocab)
    script = PAUSE_SAVES + _CHILD.format(first=first, a1=a1_ref, extra=extra, n=NEW_TOKENS)
    child = subprocess.Popen([sys.executable, "-c", script, str(model)], stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not seen or ("session save paused" not in seen[-1] and seen[-1]):
            seen.append(child.stderr.readline())
        assert seen[-1], f"the child never reached the save: {''.join(seen)}"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    a2, fed, session = resume_and_continue(model, prompt, vocab, a1_ref)
    assert "unfinished" in (session.notice or ""), session.notice
    assert a2 == a2_ref, "after kill -9 during a save, the resumed session's tokens differ"
    assert fed == len(extra) + 1


INJECTED = "Input/output error (injected)"


@contextmanager
def failing_read(error: str | BaseException = INJECTED):
    """Within the block the next expert read to finish fails, once: `IOPool.result` (the C I/O pool
    every expert read goes through) reports `error`, so the store raises ColibriError, or raises
    `error` itself when it is an exception (e.g. KeyboardInterrupt, as Ctrl-C would)."""
    real = IOPool.__dict__["result"]
    armed = [True]

    def result(read):
        if armed:
            armed.clear()
            if isinstance(error, BaseException):
                raise error
            return None, error
        return real.__func__(read)

    IOPool.result = staticmethod(result)
    try:
        yield
    finally:
        IOPool.result = real


def _fail_turn(engine, ids: list[int], session, after: int, error: str | BaseException = INJECTED) -> None:
    """A turn whose next expert read, once `after` tokens have come (0: in the prompt's forward, more:
    in a decode step's), fails with `error`: the failure must reach the caller and leave `session`
    exactly as it was before the call."""
    before = list(session.ids), {k: np.array(v) for k, v in session.state.arrays().items()}
    tokens = engine.stream(ids, NEW_TOKENS, stop_ids=(), session=session)
    for _ in range(after):
        next(tokens)
    try:
        with failing_read(error):
            for _ in tokens:
                pass
    except (ColibriError, KeyboardInterrupt) as e:
        assert isinstance(e, KeyboardInterrupt) or INJECTED in str(e), f"another error than the injected one: {e}"
    else:
        raise AssertionError(f"a read failing after {after} tokens did not reach the caller")
    arrays = session.state.arrays()
    assert session.ids == before[0] and session.state.length == len(before[0]), \
        f"a forward failing after {after} tokens left the session changed"
    assert arrays.keys() == before[1].keys() and all(np.array_equal(arrays[k], a) for k, a in before[1].items()), \
        f"a forward failing after {after} tokens left the state changed"


def check_failed_forward(model_dir: Path, work: Path, prompt: list[int], vocab: int) -> None:
    """A read error or Ctrl-C in the middle of a forward (the prompt's, a decode step's) leaves the
    session exactly as it was before the call, and continuing it gives the uninterrupted run's
    tokens; `logits` leaves nothing behind either, and no failed turn ends (`store.end_turn`: the
    routing history beside the model is not saved, nor the hot-store revised). A
    persistent session never saves a failed turn: a fresh engine resumes it from the last good one."""
    a1_ref, a2_ref = uninterrupted(model_dir, prompt, vocab)
    model = work / "model-faults"
    shutil.copytree(model_dir, model)
    first, extra = _turns(prompt, vocab)
    second = first + a1_ref + extra
    history = work / "faults.coli_usage"  # saved at each turn's end, and only then
    with load(model, cache_slots=1, usage=history) as engine:  # one slot per layer: every forward reads
        s = engine.new_session()
        assert engine.generate(first, NEW_TOKENS, stop_ids=(), session=s) == a1_ref
        logits = engine.logits(second)
        saved_history = history.read_bytes()
        _fail_turn(engine, first, engine.new_session(), 1)  # a fresh session stays fresh
        for after, error in ((0, INJECTED), (2, INJECTED), (2, KeyboardInterrupt())):
            _fail_turn(engine, second, s, after, error)
        try:
            with failing_read():
                engine.logits(second)
            raise AssertionError("a read failing in `logits` did not reach the caller")
        except ColibriError as e:
            assert INJECTED in str(e), f"another error than the injected one: {e}"
        assert history.read_bytes() == saved_history, "a failed call ended its turn (its routing history was saved)"
        assert engine.generate(second, NEW_TOKENS, stop_ids=(), session=s) == a2_ref, \
            "after failed forwards, the session's tokens differ from the uninterrupted run"
        assert np.array_equal(engine.logits(second), logits), "after a failed `logits`, the logits differ"
        # persistent sessions: the failed turn is never saved, in this engine or a fresh one
        assert engine.generate(first, NEW_TOKENS, stop_ids=(), session="s") == a1_ref
        saved = session_path(model, "s").read_bytes()
        _fail_turn(engine, second, engine.open_session("s"), 2)
        assert session_path(model, "s").read_bytes() == saved, "the failed turn was saved"
        assert engine.generate(first, NEW_TOKENS, stop_ids=(), session="t") == a1_ref
        _fail_turn(engine, second, engine.open_session("t"), 0, KeyboardInterrupt())
        assert engine.generate(second, NEW_TOKENS, stop_ids=(), session="t") == a2_ref
    a2, fed, session = resume_and_continue(model, prompt, vocab, a1_ref)
    assert session.notice is None and a2 == a2_ref, "a resumed session's tokens differ after a failed turn"
    assert fed == len(extra) + 1, f"resuming re-prefilled {fed} tokens, expected only the {len(extra) + 1} new ones"
    with load(model, usage=False) as engine:
        t = engine.open_session("t")
        assert t.notice is None and t.ids == second + a2_ref[:-1], "a turn after a failed one was not saved whole"
