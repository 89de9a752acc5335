"""The corruption campaign: every file kind the engine reads, damaged four ways (truncated, a flipped
byte, a wrong version, the same file from another model of the same shapes), under `colibri run`
and `colibri chat`. Each case is refused with one line naming the file and what to do, or, where a
fallback is allowed (the routing history, a session), the fallback is taken and said in one line
and the tokens are the undamaged run's: never a traceback, never a wrong token; `colibri doctor
--deep` fails naming the damaged container file.

Also the traceback defects of issue 22: a deeply nested config.json (run, doctor, chat), a deeply
nested `.coli_usage` or counts of 2**70 under a valid checksum (`colibri serve` must not exit); and
every file the engine reads whole, far larger than its bound (sparse: nothing is written): refused
before it is read, in one line naming the file and the bound.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
import zlib
from pathlib import Path

import pytest
import yaml

from colibri_core import fsio
from colibri_core.errors import ColibriError
from colibri_core.kv.session import HEAD, session_path
from colibri_core.sizes import format_bytes
from colibri_core.store.usage import USAGE_FILE

from conftest import colibri

PROMPT = "the quick brown"
RUN = ["run", "--temperature", "0", "--max-tokens", "8", "--cache-slots", "8"]
CHAT = ["chat", "--temperature", "0", "--max-tokens", "6", "--cache-slots", "8"]
FIXES = ("reconvert the model", "restore it", "upgrade colibri")


def cli(*args, stdin: str | None = None):
    """`colibri ARGS` in this process: (exit code, stdout, stderr, the error or None, warnings).
    A `ColibriError` is what the real CLI prints as one `colibri: error:` line with status 1;
    any other exception would be a traceback."""
    from typer.testing import CliRunner

    from colibri_core.cli import app

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = CliRunner().invoke(app, [str(a) for a in args], input=stdin)
    if r.exception is not None and not isinstance(r.exception, (ColibriError, SystemExit)):
        raise AssertionError(f"colibri {' '.join(map(str, args))}: a traceback") from r.exception
    error = r.exception if isinstance(r.exception, ColibriError) else None
    return r.exit_code, r.stdout, r.stderr, error, [str(w.message) for w in caught
                                                    if issubclass(w.category, UserWarning)]


def checkpoint(d: Path, seed: int) -> Path:
    from colibri_olmoe.demo import CHAT_TEMPLATE, write_checkpoint, write_tokenizer

    d.mkdir(parents=True)
    eos = write_tokenizer(d, ["the quick brown fox jumps over the lazy dog " * 20, f"seed {seed} " * 5], 300)
    write_checkpoint(d, vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_experts=8,
                     num_experts_per_tok=2, eos_token_id=eos, seed=seed)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    if seed:  # another model: its small files differ too
        for name, edit in (("config.json", {"rms_norm_eps": 1e-6}), ("generation_config.json", {"temperature": 0.6}),
                           ("tokenizer_config.json", {"model_max_length": 2048})):
            (d / name).write_text(json.dumps({**json.loads((d / name).read_text()), **edit}, indent=2))
        (d / "chat_template.jinja").write_text("{{ bos_token }}" + CHAT_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Two containers of the same shapes and other weights ("ours", "other"), each with a chat
    session and a routing history, and what ours answers undamaged."""
    from colibri_core.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("corrupt")
    out = {}
    for name, seed in (("ours", 0), ("other", 1)):
        convert_checkpoint(checkpoint(root / f"{name}-hf", seed), root / name, "int4", progress=False)
        code, _, err, error, _ = cli(*CHAT, "--model", root / name, "--session", "s", stdin="the quick\n")
        assert code == 0, (err, error)
        assert (root / name / USAGE_FILE).is_file() and session_path(root / name, "s").is_file()
        out[name] = root / name
    code, text, _, error, _ = cli(*RUN, "--model", out["ours"], PROMPT)
    assert code == 0, error
    out["text"] = text
    out["chat"] = {}
    for lines in (["brown fox"], ["the quick", "brown fox"]):  # a fresh chat; the session continued
        code, text, _, error, _ = cli(*CHAT, "--model", out["ours"], stdin="".join(x + "\n" for x in lines))
        assert code == 0, error
        out["chat"][len(lines)] = text.split("> ")[-2]  # the last answer
    return out


@pytest.fixture(scope="module")
def fresh_history(models, tmp_path_factory) -> dict:
    """The routing history that one run of PROMPT writes into a copy of ours that had none."""
    m = tmp_path_factory.mktemp("fresh") / "m"
    shutil.copytree(models["ours"], m)
    (m / USAGE_FILE).unlink()
    code, _, _, error, _ = cli(*RUN, "--model", m, PROMPT)
    assert code == 0, error
    return json.loads((m / USAGE_FILE).read_text())


@pytest.fixture
def model(models, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(models["ours"], dst)
    return dst


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x20
    path.write_bytes(bytes(data))


def wrong_version(path: Path) -> None:
    """The file as a later format version would write it (where the kind has no version field of
    its own, the version field its format defines)."""
    name = path.name
    if name == "colibri.yaml":
        text = path.read_text().replace("format_version: 1\n", "format_version: 2\n")
        text = text[: text.rfind("# crc32")]
        from colibri_core.container.reader import manifest_checksum_line

        path.write_text(text + manifest_checksum_line(text))
    elif name == USAGE_FILE:
        d = json.loads(path.read_text())
        d["version"] = 2
        path.write_text(json.dumps(d))
    elif name.endswith(".coli_session"):
        data = bytearray(path.read_bytes())
        data[8:12] = (2).to_bytes(4, "little")
        path.write_bytes(bytes(data))
    elif name.endswith(".bin"):  # the extent trailers' magic
        data = path.read_bytes().replace(b"CLXE", b"CLX2")
        path.write_bytes(data)
    elif name == "resident.safetensors":
        data = path.read_bytes().replace(b'"format":"colibri"', b'"format":"colibr2"')
        path.write_bytes(data)
    elif name == "tokenizer.json":
        d = json.loads(path.read_text())
        d["version"] = "2.0"
        path.write_text(json.dumps(d))
    elif name == "chat_template.jinja":
        path.write_text("{# version 2 #}" + path.read_text())
    else:  # config.json, generation_config.json, tokenizer_config.json: transformers_version
        d = json.loads(path.read_text())
        d["transformers_version"] = "99.0.0"
        path.write_text(json.dumps(d))


DAMAGE = {"truncated": truncate, "flipped byte": flip, "wrong version": wrong_version}
CONTAINER_FILES = ["colibri.yaml", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "resident.safetensors", "experts/layer-001.bin"]


def assert_refused(error, code, rel: str) -> None:
    assert code == 1 and error is not None, f"damaged {rel} was not refused"
    msg = str(error)
    assert len(msg.splitlines()) == 1, msg
    assert Path(rel).name in msg, f"the error does not name {rel}: {msg}"
    assert any(fix in msg for fix in FIXES) or "doctor" in msg, f"the error says no fix: {msg}"


@pytest.mark.parametrize("damage", [*DAMAGE, "from another model"])
@pytest.mark.parametrize("rel", CONTAINER_FILES)
def test_damaged_container_file_is_refused(models, model, rel, damage):
    path = model / rel
    if damage == "from another model":
        shutil.copyfile(models["other"] / rel, path)
    else:
        DAMAGE[damage](path)
    code, text, err, error, _ = cli(*RUN, "--model", model, PROMPT)
    if rel.startswith("experts/") and damage == "flipped byte" and code == 0:
        # a flipped byte in an expert this prompt never routes to: the tokens are right (its bytes
        # were never used), and doctor --deep finds it
        assert text == models["text"]
        code, out, _, error, _ = cli("doctor", "--model", model, "--deep")
        assert code == 1 and "layer-001.bin" in out and "fails its checksum" in out, out
        return
    assert_refused(error, code, rel)
    assert text == "", "a token came out of a damaged model"
    code, text, _, error, _ = cli(*CHAT, "--model", model, stdin="brown fox\n")
    assert_refused(error, code, rel)
    assert text in ("", "> "), "a token came out of a damaged model"
    code, out, _, _, _ = cli("doctor", "--model", model, "--deep")
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert code == 1 and fails and Path(rel).name in "".join(fails), out


def test_every_expert_extent_flipped_is_refused_or_unused(models, model):
    """A flipped byte in each of a layer's experts in turn: the run refuses (naming the file and
    the expert) or, for an expert the prompt never routes to, gives the undamaged tokens."""
    path = model / "experts" / "layer-000.bin"
    whole = path.read_bytes()
    n = len(whole) // 8
    refused = 0
    for e in range(8):
        data = bytearray(whole)
        data[e * n + n // 3] ^= 1
        path.write_bytes(bytes(data))
        code, text, _, error, _ = cli(*RUN, "--model", model, PROMPT)
        if code == 0:
            assert text == models["text"]
        else:
            assert f"layer 0 expert {e}" in str(error) and "layer-000.bin" in str(error), error
            refused += 1
    assert refused >= 2  # top-2 routing reads at least two experts of every layer


def test_manifest_of_another_model_says_so(models, model):
    shutil.copyfile(models["other"] / "colibri.yaml", model / "colibri.yaml")
    code, _, _, error, _ = cli(*RUN, "--model", model, PROMPT)
    assert code == 1 and "colibri.yaml does not describe the files beside it" in str(error), error


@pytest.mark.parametrize("damage", [*DAMAGE, "from another model", "nested", "huge counts"])
def test_damaged_usage_history_is_ignored_with_one_warning(models, model, fresh_history, damage):
    path = model / USAGE_FILE
    if damage == "from another model":
        shutil.copyfile(models["other"] / USAGE_FILE, path)
    elif damage == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "huge counts":  # a valid checksum over counts no int64 holds
        d = json.loads(path.read_text())
        d["counts"][0][0] = 2**70
        d["crc32"] = zlib.crc32(json.dumps(d["counts"], separators=(",", ":")).encode())
        path.write_text(json.dumps(d))
    else:
        DAMAGE[damage](path)
    code, text, _, error, caught = cli(*RUN, "--model", model, PROMPT)
    assert code == 0 and error is None, error
    assert text == models["text"]
    ours = [w for w in caught if "routing history" in w]
    assert len(ours) == 1 and str(path) in ours[0] and "ignoring" in ours[0], caught
    replaced = json.loads(path.read_text())  # by this run's history alone: nothing of the damaged one kept
    assert (replaced["tokens"], replaced["counts"]) == (fresh_history["tokens"], fresh_history["counts"])


@pytest.mark.parametrize("damage", [*DAMAGE, "from another model", "cut in its last turn"])
def test_damaged_session_falls_back_and_says_so(models, model, damage):
    """A damaged session file: moved aside (or its torn last save dropped) with one line naming it,
    and the chat continues as a fresh one, with a fresh chat's answer."""
    path = session_path(model, "s")
    if damage == "from another model":
        shutil.copyfile(session_path(models["other"], "s"), path)
    elif damage == "flipped byte":
        flip(path, where=0.3)  # inside the record's data, past the header
    elif damage == "cut in its last turn":
        path.write_bytes(path.read_bytes()[:-1])
    else:
        DAMAGE[damage](path)
    code, text, err, error, _ = cli(*CHAT, "--model", model, "--session", "s", stdin="brown fox\n")
    assert code == 0 and error is None, error
    notes = [line for line in err.splitlines() if line.startswith("colibri: note:")]
    assert len(notes) == 1 and "session s" in notes[0], err
    assert ("moved it to s.coli_session.bad" in notes[0]) != ("dropped" in notes[0]), notes
    assert text.split("> ")[-2] == models["chat"][1], "the chat did not start fresh"


def test_session_header_nested_too_deeply_is_refused(models, model):
    """A session file whose header JSON (under a valid checksum) is nested too deeply to parse."""
    path = session_path(model, "s")
    ident = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(HEAD.pack(b"COLISESS", 1, len(ident)) + ident + zlib.crc32(ident).to_bytes(4, "little"))
    code, text, err, error, _ = cli(*CHAT, "--model", model, "--session", "s", stdin="brown fox\n")
    assert code == 0 and "damaged header" in err and "moved it to" in err, (err, error)
    assert text.split("> ")[-2] == models["chat"][1]


def test_an_intact_session_continues(models, model):
    code, text, err, error, _ = cli(*CHAT, "--model", model, "--session", "s", stdin="brown fox\n")
    assert code == 0 and "colibri: note" not in err and "resumed session s: 2 messages" in err, err
    assert text.split("> ")[-2] == models["chat"][2]


# ----------------------------------------------------------------------------- tracebacks of issue 22


NESTED = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("command", [["run", "hello"], ["doctor"], ["chat"]])
def test_deeply_nested_config_json_is_one_line(model, command):
    (model / "config.json").write_text(NESTED)
    r = colibri(*command, "--model", model, input="hi\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    if command == ["doctor"]:
        assert "FAIL" in r.stdout and "nested too deeply" in r.stdout, r.stdout
        return
    assert r.stderr.count("\n") == 1 and "config.json" in r.stderr and "nested too deeply" in r.stderr, r.stderr


def test_convert_refuses_a_deeply_nested_source_config(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(NESTED)
    r = colibri("convert", src, tmp_path / "out")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "nested too deeply" in r.stderr, r.stderr


BROKEN = {
    "generation_config.json": [NESTED, '{"eos_token_id": "</s>"}'],
    "tokenizer_config.json": [NESTED, "[7]"],
    "tokenizer.json": [NESTED, '{"version": "1.0"}'],
    "chat_template.jinja": ["{% for m in messages %}", "{{ raise_exception('no system role here') }}"],
}


@pytest.mark.parametrize("rel", BROKEN)
def test_unlisted_files_broken_are_one_line(model, rel):
    """A file the manifest does not list (added after conversion) is read unchecked, but a broken
    one (nested too deeply, not what the format holds, a template that does not compile or raises)
    still fails as one line naming it."""
    m = yaml.safe_load((model / "colibri.yaml").read_text())
    del m["files"][rel]
    (model / "colibri.yaml").write_text(yaml.safe_dump(m, sort_keys=False))  # edited: no checksum line
    for text in BROKEN[rel]:
        (model / rel).write_text(text)
        code, out, _, error, _ = cli(*RUN, "--chat", "--model", model, PROMPT)
        assert code == 1 and rel in str(error) and len(str(error).splitlines()) == 1 and out == "", (text[:40], error)


def test_serve_survives_a_nested_routing_history(model):
    """`colibri serve` with a nested .coli_usage: one warning, and it serves."""
    from live_server import LiveServer

    (model / USAGE_FILE).write_text(NESTED)
    server = LiveServer("serve", model, "--cache-slots", "8")
    try:
        status, _ = server.get("/v1/models")
        assert status == 200
        log = server.text_log()
        assert log.count("ignoring routing history") == 1 and "Traceback" not in log, log
    finally:
        server.stop()


# ------------------------------------------------------------------ files larger than the engine reads
HUGE = 1 << 30  # a sparse file's size: once read whole, 1-2 GB of RSS
PEAK_RSS = 512 << 20  # what a refusal may take: a run of the tiny model peaks near 70 MB


# `python -m colibri_core`, writing its own peak RSS (VmHWM: the process after exec) to $COLIBRI_TEST_PEAK as
# it exits. wait4's ru_maxrss would also count the pages of the pytest process it was forked from, which a
# whole run grows past PEAK_RSS.
PEAK_CHILD = ("import atexit, os, runpy, sys; atexit.register(lambda: open(os.environ['COLIBRI_TEST_PEAK'], 'w')"
              ".write(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1])); "
              "sys.argv[0] = 'colibri'; runpy.run_module('colibri_core', run_name='__main__', alter_sys=True)")


def measured(*args, timeout: float = 120) -> tuple[int, str, float]:
    """`colibri ARGS` in a subprocess: (exit code, its stderr, its peak RSS in bytes; inf if it never
    said, e.g. killed)."""
    with tempfile.TemporaryFile() as err, tempfile.TemporaryDirectory() as d:
        peak = Path(d) / "peak"
        proc = subprocess.Popen([sys.executable, "-c", PEAK_CHILD, *map(str, args)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "COLIBRI_TEST_PEAK": str(peak)})
        killer = threading.Timer(timeout, proc.kill)  # a bound on waiting (the FIFO case: an open that never returns)
        killer.start()
        try:
            _, status = os.waitpid(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        return proc.returncode, err.read().decode(), int(peak.read_text()) * 1024 if peak.exists() else float("inf")


def unlist(model: Path, rel: str) -> None:
    """Take `rel` out of the manifest's file list (its size and checksum no longer checked first)."""
    m = yaml.safe_load((model / "colibri.yaml").read_text())
    del m["files"][rel]
    (model / "colibri.yaml").write_text(yaml.safe_dump(m, sort_keys=False))  # edited: no checksum line


def sparse(path: Path, size: int = HUGE) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("rel,bound,args", [
    ("colibri.yaml", fsio.MANIFEST_BYTES, ["run", PROMPT]),
    ("tokenizer.json", fsio.TOKENIZER_BYTES, ["run", PROMPT]),
    ("tokenizer_config.json", fsio.TOKENIZER_BYTES, ["run", "--chat", PROMPT]),
    ("generation_config.json", fsio.CONFIG_BYTES, ["run", PROMPT]),
    ("chat_template.jinja", fsio.TEMPLATE_BYTES, ["run", "--chat", PROMPT]),
    ("big.lark", fsio.GRAMMAR_BYTES, ["run", "--grammar", "{model}/big.lark", PROMPT]),
    ("big.json", fsio.GRAMMAR_BYTES, ["run", "--json-schema", "{model}/big.json", PROMPT]),
])
def test_a_file_past_its_bound_is_refused_unread(model, rel, bound, args):
    if rel in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        unlist(model, rel)
    sparse(model / rel)
    code, err, peak = measured(*[a.format(model=model) for a in args], "--model", model)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert rel in err and f"is {format_bytes(HUGE)}, more than the {format_bytes(bound)}" in err, err
    assert peak < PEAK_RSS, f"{peak >> 20} MiB to refuse a {HUGE >> 20} MiB {rel}"


def test_a_source_config_past_its_bound_is_refused_unread(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    sparse(src / "config.json")
    code, err, peak = measured("convert", src, tmp_path / "out")
    assert code == 1 and err.count("\n") == 1 and "config.json" in err and format_bytes(fsio.CONFIG_BYTES) in err, err
    assert peak < PEAK_RSS, f"{peak >> 20} MiB to refuse a {HUGE >> 20} MiB config.json"


def test_a_routing_history_past_its_bound_is_ignored_unread(model):
    sparse(model / USAGE_FILE)
    code, err, peak = measured(*RUN, "--model", model, PROMPT)
    warned = [line for line in err.splitlines() if "routing history" in line]
    assert code == 0 and len(warned) == 1 and USAGE_FILE in warned[0] and "more than the" in warned[0], err
    assert peak < PEAK_RSS, f"{peak >> 20} MiB to ignore a {HUGE >> 20} MiB {USAGE_FILE}"


def test_a_schema_from_a_fifo_nobody_writes_is_one_line(model, tmp_path):
    """A FIFO nobody writes (read as it was, the open never returned) reads as empty: not a schema, in
    one line; a device (/dev/zero, read as it was, grew the process until the kernel killed it) is
    cut at the bound (test_io, in-process)."""
    os.mkfifo(tmp_path / "schema.json")
    code, err, _ = measured("run", "--json-schema", tmp_path / "schema.json", "--model", model, PROMPT, timeout=60)
    assert code == 1 and err.count("\n") == 1 and "schema.json" in err, err


def test_a_session_header_past_its_bound_is_refused(models, model):
    """A session file whose header (under a valid checksum) is longer than a header may be: refused
    before its JSON is parsed, and the chat starts fresh."""
    path = session_path(model, "s")
    ident = b" " * fsio.SESSION_HEADER_BYTES + b"{}"
    path.write_bytes(HEAD.pack(b"COLISESS", 1, len(ident)) + ident + zlib.crc32(ident).to_bytes(4, "little"))
    code, text, err, error, _ = cli(*CHAT, "--model", model, "--session", "s", stdin="brown fox\n")
    assert code == 0 and "damaged header" in err and str(fsio.SESSION_HEADER_BYTES) in err, (err, error)
    assert text.split("> ")[-2] == models["chat"][1]
