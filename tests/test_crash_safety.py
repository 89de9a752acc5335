"""`kill -9` at random points of `colibri convert`, of a chat session's save and of a `.coli_usage`
update: the next run never trusts a damaged artifact, resumes what can be resumed, and its output
is identical to an uninterrupted run's. Also the resume of `convert` bound to the source's content
and one record per chat turn.

Each kill test runs COLIBRI_KILL_TRIALS trials (default 3: CI), seeded by COLIBRI_KILL_SEED, and
prints where its kills landed (`pytest -s`); RELIABILITY.md gives the longer run's command and
counts. The kill times are random (uniform over the work, measured by an uninterrupted run); a
session save is slowed (in the child process: the conformance kit's `PAUSE_SAVES`, at a random byte of
the record) and a usage update's fsyncs are, so that most kills land inside one.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest

from colibri_core.container import Container
from colibri_core.convert import convert_checkpoint
from colibri_core.engine import load
from colibri_core.errors import ColibriError
from colibri_core.kv.session import SessionFile, session_path
from colibri_core.store.usage import USAGE_FILE, ColibriWarning
from colibri_core.testing.sessions import PAUSE_SAVES

from conftest import COLIBRI

TRIALS = int(os.environ.get("COLIBRI_KILL_TRIALS", "3"))
SEED = int(os.environ.get("COLIBRI_KILL_SEED", "0"))


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(60)


def report(what: str, landed: Counter) -> None:
    print(f"\n{what}: {sum(landed.values())} kill -9 trials (seed {SEED}); landed: "
          + ", ".join(f"{k}: {n}" for k, n in sorted(landed.items())))


# ----------------------------------------------------------------------------- convert


def checkpoint(d: Path, seed: int) -> Path:
    from colibri_olmoe.demo import write_checkpoint

    return write_checkpoint(d, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                            num_experts=16, seed=seed)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two checkpoints of the same shapes and other weights (A, B), and A's uninterrupted container."""
    root = tmp_path_factory.mktemp("convert")
    a, b = checkpoint(root / "A", seed=0), checkpoint(root / "B", seed=1)
    convert_checkpoint(a, root / "A-int4", "int4", progress=False)
    convert_checkpoint(b, root / "B-int4", "int4", progress=False)
    return {"A": a, "B": b, "A-int4": root / "A-int4", "B-int4": root / "B-int4"}


def convert_quietly(src: Path, dst: Path) -> str:
    """Convert in this process, as `colibri convert` does; returns what it said on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        convert_checkpoint(src, dst, "int4", progress=True)
    return err.getvalue()


def interrupted(src: Path, dst: Path, layers: int) -> None:
    """A conversion of `src` into `dst` killed once `layers` expert files are finished."""
    from colibri_core.container import writer

    real, done = writer._write_layer, []

    def layer(*args):
        if len(done) == layers:
            raise KeyboardInterrupt
        done.append(real(*args))
        return done[-1]

    writer._write_layer = layer
    try:
        with pytest.raises(KeyboardInterrupt):
            convert_checkpoint(src, dst, "int4", progress=False)
    finally:
        writer._write_layer = real


def test_resume_never_mixes_two_checkpoints_of_the_same_shapes(sources, tmp_path):
    """The defect: `convert A dst`, killed after a few layers, then `convert B dst` (same shapes,
    other weights) resumed A's files and published A's first layers with B's later ones."""
    dst = tmp_path / "out"
    interrupted(sources["A"], dst, layers=3)
    said = convert_quietly(sources["B"], dst)
    notice = [line for line in said.splitlines() if "discarding" in line]
    assert len(notice) == 1 and "converted from other weights than" in notice[0] and "resuming" in said, said
    assert files_of(dst) == files_of(sources["B-int4"])
    assert Container(dst).manifest["source"]["fingerprint"] != Container(sources["A-int4"]).manifest["source"]["fingerprint"]


def test_resume_notices_a_source_changed_in_place(sources, tmp_path):
    """A tensor of the source edited after the interruption (same names, shapes and file size):
    the staging directory is discarded; unchanged sources resume, keeping finished files."""
    src, dst = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sources["A"], src)
    interrupted(src, dst, layers=2)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.experts.5.up_proj.weight"][0, 0] += 1  # layer 1 was finished
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    said = convert_quietly(src, tmp_path / "same")  # another destination: nothing to resume
    assert "resuming" not in said and "discarding" not in said
    said = convert_quietly(src, dst)
    assert "discarding" in said and "layer-001.bin was converted from other weights" in said, said
    shutil.rmtree(dst)
    interrupted(src, dst, layers=2)
    mtime = (tmp_path / "out.partial" / "experts" / "layer-000.bin").stat().st_mtime_ns
    said = convert_quietly(src, dst)
    assert "resuming" in said and "discarding" not in said, said
    assert (dst / "experts" / "layer-000.bin").stat().st_mtime_ns == mtime  # kept, not rewritten
    assert files_of(dst) == files_of(tmp_path / "same")  # the edited source, converted uninterrupted


def test_leftovers_of_a_kill_are_resumed_or_cleared(sources, tmp_path):
    """What a kill can leave in DST.partial besides finished files: a file cut short, write_atomic's
    temporaries, a directory made before progress.json: resumed (or started over) without a word
    of "not a colibri staging directory", and nothing of it reaches the container."""
    dst, staging = tmp_path / "out", tmp_path / "out.partial"
    interrupted(sources["A"], dst, layers=1)
    (staging / "experts" / "layer-001.bin").write_bytes(b"half an expert file")
    (staging / "progress.json.99999999.tmp").write_text("{")
    (staging / "colibri.yaml.99999999.tmp").write_text("format: colibri-con")
    convert_quietly(sources["A"], dst)
    assert files_of(dst) == files_of(sources["A-int4"])
    shutil.rmtree(dst)
    interrupted(sources["A"], dst, layers=2)  # a progress.json naming what no conversion writes
    progress = json.loads((staging / "progress.json").read_text())
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    progress["files"]["../outside.txt"] = {"size": 9, "crc32": 0}
    progress["files"]["experts/layer-099.bin"] = progress["files"]["experts/layer-000.bin"]
    del progress["files"]["experts/layer-001.bin"]["extent_crc32"]
    shutil.copyfile(staging / "experts/layer-000.bin", staging / "experts/layer-099.bin")
    (staging / "progress.json").write_text(json.dumps(progress))
    convert_quietly(sources["A"], dst)
    assert files_of(dst) == files_of(sources["A-int4"]) and outside.read_text() == "not yours"
    shutil.rmtree(dst)
    interrupted(sources["A"], dst, layers=1)
    with pytest.raises(ColibriError, match="unfinished conversion"):  # `colibri run --model DST.partial`
        load(staging)
    shutil.rmtree(staging)
    staging.mkdir()
    (staging / "experts").mkdir()  # killed right after making the directories
    convert_quietly(sources["A"], dst)
    assert files_of(dst) == files_of(sources["A-int4"])


@pytest.mark.system
def test_kill9_convert_at_random_points(sources, tmp_path):
    """`colibri convert` killed at a random moment of its work, then run again: never a half
    container at DST, the staging directory refused as a model until its manifest (the last file)
    is written, finished files resumed, and the container byte-identical to an uninterrupted one."""
    src, ref = sources["A"], files_of(sources["A-int4"])
    dst, staging = tmp_path / "out", tmp_path / "out.partial"
    cmd = [*COLIBRI, "convert", str(src), str(dst), "--quant", "int4"]
    t0 = time.monotonic()  # an uninterrupted run: how long the work takes once the staging appears
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not staging.exists() and proc.poll() is None:
        time.sleep(0.001)
    t1 = time.monotonic()
    assert proc.wait(120) == 0 and files_of(dst) == ref
    work = time.monotonic() - t1
    assert work > 0.05, f"the conversion is too quick ({work:.3f} s after {t1 - t0:.2f} s) to kill inside"
    rng, landed = random.Random(SEED), Counter()
    for trial in range(TRIALS):
        shutil.rmtree(dst)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while not staging.exists() and proc.poll() is None:
            time.sleep(0.001)
        time.sleep(rng.uniform(0, work))
        kill(proc)
        if (dst / "colibri.yaml").exists():
            landed["after publishing"] += 1
            assert files_of(dst) == ref, f"trial {trial}: a published container differs"
            assert not staging.exists()
            continue
        assert not dst.exists(), f"trial {trial}: a half-written container at the destination"
        progress = json.loads((staging / "progress.json").read_text()) if (staging / "progress.json").exists() else None
        finished = len(progress["files"]) if progress else 0
        landed["before the first file was finished" if not finished else
               f"{finished} of 7 files finished" if not (staging / "colibri.yaml").exists() else "manifest written"] += 1
        if (staging / "colibri.yaml").exists():  # killed after the manifest, its last file: whole, not yet renamed
            assert Container(staging).verify(deep=True) == []
        else:
            with pytest.raises(ColibriError, match="unfinished conversion"):
                Container(staging)
        publishing = progress is None and (staging / "colibri.yaml").exists()  # killed between its last steps
        said = convert_quietly(src, dst)
        if publishing:
            assert "interrupted as it was being published" in said, (trial, said)
        else:
            assert "discarding" not in said and ("resuming" in said or progress is None), (trial, said)
        assert files_of(dst) == ref, f"trial {trial}: the resumed container differs from an uninterrupted one"
        assert not staging.exists()
    report("colibri convert", landed)


# ----------------------------------------------------------------------------- chat sessions

PROMPTS = ["the quick", "brown fox", "jumps over", "the lazy dog"]
CHAT = ["chat", "--temperature", "0", "--max-tokens", "6"]


def saved_messages(path: Path) -> tuple[list, str | None]:
    """The messages a session file holds (its whole turns), and its notice (a torn last save). Read
    from a copy: loading cuts a torn save off the file (kept in .torn), and the restart must see it."""
    data = path.read_bytes()
    n = int.from_bytes(data[12:16], "little")
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / path.name
        copy.write_bytes(data)
        f = SessionFile(copy, json.loads(data[16:16 + n]))
        saved = f.load()
    assert f.notice is None or "unfinished" in f.notice, f.notice
    return ([] if saved is None else saved.meta["messages"]), f.notice


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory) -> tuple[Path, list]:
    """A private copy of the tiny model, and the messages of an uninterrupted chat over PROMPTS."""
    m = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(tiny_model, m)
    r = subprocess.run([*COLIBRI, *CHAT, "--model", str(m), "--session", "ref"], input="\n".join(PROMPTS) + "\n",
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    messages, _ = saved_messages(session_path(m, "ref"))
    assert [x["role"] for x in messages] == ["user", "assistant"] * len(PROMPTS)
    return m, messages


def test_chat_saves_one_record_per_turn(chat_model, monkeypatch):
    """State and messages are written together: each turn of `colibri chat --session` is one write
    of one record, whose messages end on that turn's answer (before, the state was one record and
    the messages another, and a kill between them resumed on a question without its answer)."""
    from typer.testing import CliRunner

    from colibri_core.cli import app

    m, ref = chat_model
    writes, real = [], SessionFile.append

    def append(self, ids, arrays, meta, continues, turn=None):
        writes.append((turn, json.loads(json.dumps(meta["messages"]))))
        return real(self, ids, arrays, meta, continues, turn)

    monkeypatch.setattr(SessionFile, "append", append)
    r = CliRunner().invoke(app, [*CHAT, "--model", str(m), "--session", "one"], input="\n".join(PROMPTS) + "\n")
    assert r.exit_code == 0, r.output
    assert writes == [(t + 1, ref[: 2 * t + 2]) for t in range(len(PROMPTS))]


@pytest.mark.system
def test_kill9_chat_session_at_random_points_of_a_save(chat_model):
    """`colibri chat --session` killed at a random moment while it saves a turn (each save paused at
    a random byte of its record), then restarted: the session resumes on the last whole turn, with
    a notice when a save was cut, and the rest of the conversation is the uninterrupted one's."""
    m, ref = chat_model
    rng, landed = random.Random(SEED), Counter()
    for trial in range(TRIALS):
        name = f"k{SEED}-{trial}"
        chat = PAUSE_SAVES + f"pause_saves(0.25, {rng.uniform(0, 1)})\nfrom colibri_core.cli import main\nmain()\n"
        proc = subprocess.Popen([sys.executable, "-c", chat, *CHAT, "--model", str(m), "--session", name],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        proc.stdin.write("\n".join(PROMPTS) + "\n")
        proc.stdin.close()
        while "colibri chat" not in (proc.stderr.readline() or "colibri chat"):
            pass  # the model is loaded
        time.sleep(rng.uniform(0, 1.2))  # four saves of 0.25 s and a little generation
        kill(proc)
        path = session_path(m, name)
        fresh_cut = path.with_name(path.name + ".tmp").exists()  # a save written beside the file, cut
        messages, notice = saved_messages(path) if path.exists() else ([], None)
        torn = notice is not None or fresh_cut
        landed[f"{'inside' if torn else 'outside'} a save, {len(messages) // 2} turns saved"] += 1
        assert messages == ref[: len(messages)] and len(messages) % 2 == 0, f"trial {trial}: not whole turns"
        rest = PROMPTS[len(messages) // 2:]
        r = subprocess.run([*COLIBRI, *CHAT, "--model", str(m), "--session", name], input="".join(
            x + "\n" for x in rest), capture_output=True, text=True)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (trial, r.stderr)
        assert (notice is not None) == ("dropped an unfinished last save" in r.stderr), (trial, r.stderr)
        assert saved_messages(path)[0] == ref, f"trial {trial}: the resumed conversation differs"
        assert not path.with_name(path.name + ".tmp").exists()
    report("colibri chat --session", landed)


SESSION_CHILD = textwrap.dedent("""
    import json, sys
    from colibri_core.engine import load
    extras = json.loads(sys.argv[3])
    with load(sys.argv[1], cache_slots=8) as engine:
        session = engine.open_session(sys.argv[2])
        print("ready", flush=True)
        ids = []
        for extra in extras:  # each turn extends the last: its save appends the new rows only
            ids = ids + extra
            ids = ids + engine.generate(ids, 4, stop_ids=(), session=session)
""")
EXTRAS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14], [15, 16]]


@pytest.mark.system
def test_kill9_engine_session_appends_at_random_points(tiny_model, tmp_path):
    """A session continued turn after turn (`engine.generate(session=NAME)`: each save after the
    first appends a record of the new rows), killed at a random moment while saving (each save
    paused at a random byte of its record): reopened, it holds exactly the last whole turn and
    continues with the uninterrupted run's tokens."""
    m = tmp_path / "m"
    shutil.copytree(tiny_model, m)
    with load(m, cache_slots=8, usage=False) as engine:  # the uninterrupted run
        s, ids, after = engine.new_session(), [], []
        for extra in EXTRAS:
            ids = ids + extra
            ids = ids + engine.generate(ids, 4, stop_ids=(), session=s)
            after.append((list(s.ids), list(ids)))  # (the state's ids, the conversation) after each turn
    rng, landed = random.Random(SEED), Counter()
    for trial in range(TRIALS):
        name = f"a{SEED}-{trial}"
        child = PAUSE_SAVES + f"pause_saves(0.25, {rng.uniform(0, 1)})\n" + SESSION_CHILD
        log = tmp_path / "child.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", child, str(m), name, json.dumps(EXTRAS)],
                                    stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout.readline() == "ready\n", log.read_text()
        time.sleep(rng.uniform(0, 1.4))  # five saves of 0.25 s and a little generation
        kill(proc)
        path = session_path(m, name)
        fresh_cut = path.with_name(path.name + ".tmp").exists()
        with load(m, cache_slots=8, usage=False) as engine, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s = engine.open_session(name)
            turns = s.turns
            assert turns <= len(EXTRAS) and s.ids == (after[turns - 1][0] if turns else []), trial
            assert s.notice is None or "unfinished" in s.notice, (trial, s.notice)
            landed[f"{'inside' if s.notice or fresh_cut else 'outside'} a save, {turns} turns saved"] += 1
            ids = after[turns - 1][1] if turns else []
            for k in range(turns, len(EXTRAS)):
                ids = ids + EXTRAS[k]
                ids = ids + engine.generate(ids, 4, stop_ids=(), session=s)
                assert ids == after[k][1], f"trial {trial}: turn {k + 1} differs from the uninterrupted run"
        assert not path.with_name(path.name + ".tmp").exists()
        assert path.read_bytes().count(b"TURN") == len(EXTRAS), "the turns were not appended one record each"
    report("engine session appends", landed)


# ----------------------------------------------------------------------------- routing history

USAGE_CHILD = textwrap.dedent("""
    import os, sys, time
    from colibri_core.engine import load
    fsync = os.fsync
    os.fsync = lambda fd: (time.sleep(0.03), fsync(fd))  # widen the write: most kills land inside one
    with load(sys.argv[1], cache_slots=2) as engine:
        print("ready", flush=True)
        while True:
            engine.generate(list(range(3, 13)), 4, stop_ids=())  # each turn rewrites .coli_usage
""")


@pytest.mark.system
def test_kill9_during_usage_updates(tiny_model, tmp_path):
    """A process updating `.coli_usage` after every turn, killed at random moments: the next run
    finds a whole history (the last saved or the one before it), never a warning, one more turn's
    worth of tokens each time, no temporary left behind, and the same tokens as without history."""
    m = tmp_path / "m"
    shutil.copytree(tiny_model, m)
    (m / USAGE_FILE).unlink(missing_ok=True)  # a history of whole turns of this test's prompt only
    prompt = list(range(3, 13))
    with load(m, cache_slots=2, usage=False) as e:
        want = e.generate(prompt, 4, stop_ids=())
    per_turn = len(prompt) + 3  # tokens routed through the first MoE layer: the prompt, 3 decode steps
    rng, landed, before = random.Random(SEED), Counter(), 0
    for trial in range(TRIALS):
        log = tmp_path / "child.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", USAGE_CHILD, str(m)], stdout=subprocess.PIPE, stderr=err,
                                    text=True)
        assert proc.stdout.readline() == "ready\n", log.read_text()
        time.sleep(rng.uniform(0.05, 0.5))
        kill(proc)
        temporaries = list(m.glob(f"{USAGE_FILE}.*.tmp"))
        landed["inside a write (a temporary left)" if temporaries else "between writes"] += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with load(m, cache_slots=2) as e:
                tokens = e.stats()["history_tokens"]
                assert e.generate(prompt, 4, stop_ids=()) == want
        assert not [w for w in caught if issubclass(w.category, ColibriWarning)], [str(w.message) for w in caught]
        assert tokens >= before and tokens % per_turn == 0, (trial, tokens, before)
        assert not list(m.glob(f"{USAGE_FILE}.*.tmp")), "a killed write's temporary was left behind"
        before = tokens + per_turn
    report(".coli_usage updates", landed)


def test_a_full_disk_is_one_line_and_the_rerun_resumes(sources, tmp_path, monkeypatch):
    """ENOSPC while writing an expert file: one line saying what stopped and that a rerun resumes;
    the rerun keeps the finished files and gives the uninterrupted container."""
    import errno

    from colibri_core.container import writer

    real, written = writer._CrcWriter.write, []

    def write(self, data):
        written.append(str(self.f.name).endswith(".bin"))
        if sum(written) == 40:  # an expert of layer 2
            raise OSError(errno.ENOSPC, "No space left on device", str(self.f.name))
        return real(self, data)

    dst = tmp_path / "out"
    with monkeypatch.context() as mp:
        mp.setattr(writer._CrcWriter, "write", write)
        with pytest.raises(ColibriError) as ei:
            convert_checkpoint(sources["A"], dst, "int4", progress=False)
    msg = str(ei.value)
    assert "No space left on device" in msg and ".bin" in msg and "resumes" in msg and len(msg.splitlines()) == 1
    said = convert_quietly(sources["A"], dst)
    assert "resuming" in said and files_of(dst) == files_of(sources["A-int4"])


def test_resume_reads_aliased_resident_tensors_as_the_writer_does(sources, tmp_path, monkeypatch):
    """A layout that finds a resident tensor under another name (`ContainerLayout.aliases`): the
    resume check re-reads it where the writer read it, so an unchanged source resumes."""
    import dataclasses

    from safetensors.numpy import load_file, save_file

    from colibri_core import plugins
    from colibri_core.container import convert, writer

    src = tmp_path / "src"
    shutil.copytree(sources["A"], src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    registry = plugins.registry()
    config = json.loads((src / "config.json").read_text())
    model_cls = registry.model_class(registry.resolve(config))
    layout = model_cls.layout(model_cls.parse_config(config))
    layout = dataclasses.replace(layout, aliases=(("model.norm.weight", "model.final_norm.weight", None, None),))

    def run(dst, **kw):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            convert(src, dst, quant="int4", layout=layout, architecture="olmoe", plugin="colibri-olmoe",
                    plugin_version="0", **kw)
        return err.getvalue()

    run(tmp_path / "ref", progress=False)
    real, done = writer._write_layer, []

    def layer(*args):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(real(*args))
        return done[-1]

    with monkeypatch.context() as mp:
        mp.setattr(writer, "_write_layer", layer)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "out", progress=False)
    said = run(tmp_path / "out")
    assert "resuming" in said and "discarding" not in said, said
    assert files_of(tmp_path / "out") == files_of(tmp_path / "ref")
