"""The command line as users of llama.cpp and ollama reach for it (issue 53): the prompt from stdin,
--system, --stop, run --session, the note when the context ends an answer, choices and extras shown
in --help, shell completion, the loading line, the prefill speed, -v / -q / COLIBRI_LOG, and the state
directory (--state-dir; never a checkpoint's own directory). The bundled demo model is the default
model: each run takes a fraction of a second."""
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import COLIBRI
from test_cli import can_mount_read_only, one_line_error, snapshot

PROMPT = "In the beginning God created"


@pytest.fixture
def env(tmp_path):
    """The environment of a colibri run whose per-user state directory is the test's own."""
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "COLUMNS": "200"}


def colibri(*args, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*COLIBRI, *map(str, args)], capture_output=True, text=True, env=env, **kw)


def prefilled(stderr: str) -> int:
    """The prompt tokens the stats line says were prefilled."""
    return int(re.search(r"prefill (\d+) tokens at [\d.]+ tok/s", stderr).group(1))


def chat_tokens(messages: list[dict]) -> int:
    """Tokens of the demo's chat template rendering `messages` with the generation prompt."""
    from colibri_core.chat_template import ChatTemplate
    from colibri_core.demo import demo_model
    from colibri_core.tokenizer import Tokenizer

    rendered = ChatTemplate.from_dir(demo_model()).render(messages)
    return len(Tokenizer.from_dir(demo_model()).encode(rendered, add_special_tokens=False))


# ---- the prompt ---------------------------------------------------------------------------------------
def test_the_prompt_comes_from_stdin_with_a_dash_or_a_pipe(env, tmp_path):
    """`colibri run - < prompt.txt` and `echo … | colibri run` answer as the prompt given as an argument
    (stdin's one final newline, echo's, left out); stdin that is not UTF-8 is one line."""
    want = colibri("run", "--max-tokens", "12", PROMPT, env=env)
    assert want.returncode == 0 and want.stdout.strip(), want.stderr
    (tmp_path / "prompt.txt").write_text(PROMPT + "\n")
    with open(tmp_path / "prompt.txt") as f:
        dash = subprocess.run([*COLIBRI, "run", "--max-tokens", "12", "-"], stdin=f, capture_output=True, text=True,
                              env=env)
    piped = colibri("run", "--max-tokens", "12", env=env, input=PROMPT + "\n")
    assert dash.stdout == piped.stdout == want.stdout, (dash.stderr, piped.stderr)
    assert prefilled(dash.stderr) == prefilled(want.stderr)
    r = subprocess.run([*COLIBRI, "run", "-"], input=b"In the \xff beginning", capture_output=True, env=env)
    one_line_error(subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode(), r.stderr.decode()),
                   "stdin is not valid UTF-8")


def test_system_message_reaches_the_model_in_run_and_chat(env):
    """--system puts a system message before the conversation: the prompt prefilled is the chat
    template's rendering of both (run and each chat turn)."""
    system, question = "Answer as the prophets did.", "Who made the light?"
    r = colibri("run", "--max-tokens", "4", "--system", system, question, env=env)
    assert r.returncode == 0, r.stderr
    both = chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": question}])
    assert prefilled(r.stderr) == both > chat_tokens([{"role": "user", "content": question}])
    r = colibri("chat", "--max-tokens", "4", "--system", system, env=env, input=question + "\n/exit\n")
    assert r.returncode == 0 and prefilled(r.stderr) == both, r.stderr


def test_stop_ends_the_answer_before_the_stop_text(env):
    full = colibri("run", "--max-tokens", "40", PROMPT, env=env)
    text = full.stdout.rstrip("\n")
    stop = text[len(text) // 2: len(text) // 2 + 5]  # five characters from the middle of the greedy answer
    assert stop.strip() and len(text) > 20, text
    cut = colibri("run", "--max-tokens", "40", "--stop", stop, "--stop", "no such text", PROMPT, env=env)
    assert cut.returncode == 0, cut.stderr
    assert cut.stdout == text[:text.index(stop)] + "\n"


def test_chat_stop_ends_the_answer_and_the_conversation_keeps_it_cut(env):
    """chat --stop as run --stop: the answer shown ends before the stop text, and so does the answer the
    conversation keeps (the next turn's prompt is the template's rendering of the cut one)."""
    question, then = "Who made the light?", "And the earth?"
    full = colibri("chat", "--max-tokens", "40", "--temperature", "0", env=env, input=f"{question}\n/exit\n")
    assert full.returncode == 0, full.stderr
    text = full.stdout.removeprefix("> ").removesuffix("\n> ")  # "> " is each question's prompt
    stop = text[len(text) // 2: len(text) // 2 + 5]
    assert stop.strip() and len(text) > 20 and "\n> " not in text, text
    cut = colibri("chat", "--max-tokens", "40", "--temperature", "0", "--stop", stop, "--stop", "no such text",
                  env=env, input=f"{question}\n{then}\n/exit\n")
    assert cut.returncode == 0, cut.stderr
    kept = text[:text.index(stop)]
    assert cut.stdout.startswith(f"> {kept}\n> "), cut.stdout
    turns = [int(n) for n in re.findall(r"prefill (\d+) tokens at", cut.stderr)]
    assert turns[1] == chat_tokens([{"role": "user", "content": question}, {"role": "assistant", "content": kept},
                                    {"role": "user", "content": then}]), cut.stderr


def test_run_session_is_a_chat_turn_that_chat_resumes(env, tmp_path):
    """`run --session` answers one turn of a saved conversation: the second run's prompt is the whole
    conversation rendered, and `chat --session` resumes all of it; the demo's directory stays as it is."""
    from colibri_core.demo import demo_model

    before = snapshot(demo_model())
    first = colibri("run", "--session", "s", "--max-tokens", "6", "Who made the heaven?", env=env)
    assert first.returncode == 0, first.stderr
    second = colibri("run", "--session", "s", "--max-tokens", "6", "And the earth?", env=env)
    assert second.returncode == 0 and "(resumed session s: 2 messages" in second.stderr, second.stderr
    conversation = [{"role": "user", "content": "Who made the heaven?"},
                    {"role": "assistant", "content": first.stdout.removesuffix("\n")},
                    {"role": "user", "content": "And the earth?"}]
    assert prefilled(second.stderr) == chat_tokens(conversation)
    r = colibri("chat", "--session", "s", env=env, input="/exit\n")
    assert "(resumed session s: 4 messages" in r.stderr, r.stderr
    assert (tmp_path / "state" / "colibri" / "colibri-demo-kjv" / ".sessions" / "s.coli_session").is_file()
    assert snapshot(demo_model()) == before


def test_a_note_says_when_the_context_ends_the_answer(env):
    """--max-tokens 5000 on the demo (a context of 1024) stopped at its context without a word."""
    r = colibri("run", "--max-tokens", "5000", PROMPT, env=env)
    n = prefilled(r.stderr)
    notes = [line for line in r.stderr.splitlines() if line.startswith("colibri: note:")]
    assert notes == [f"colibri: note: the answer stopped at the model's context (1024 tokens: {n} of prompt, "
                     f"{1024 - n} of answer), before --max-tokens 5000"], r.stderr
    assert "colibri: note:" not in colibri("run", "--max-tokens", "8", PROMPT, env=env).stderr
    r = colibri("chat", "--max-tokens", "5000", env=env, input=PROMPT + "\n/exit\n")
    assert "the answer stopped at the model's context (1024 tokens" in r.stderr, r.stderr


# ---- help, completion -----------------------------------------------------------------------------------
def test_help_lists_choices_extras_and_the_prompt_as_written():
    """Choice options list their values (they showed <str>), "colibri[ray]" keeps its extra (the
    renderer printed "(needs colibri)"), and the usage line names PROMPT (it read {prompt})."""
    from typer.testing import CliRunner

    from colibri_core import kernels
    from colibri_core.cli import app
    from colibri_core.drafting import DRAFT_MODES
    from colibri_core.kv.cache import KV_CACHES
    from colibri_core.remote.placement import SPLITS

    shown = " ".join(CliRunner().invoke(app, ["run", "--help"]).output.split())  # as one line: wrapped anywhere
    assert "Usage: colibri run [OPTIONS] [PROMPT]" in re.sub(r"Usage: \S+", "Usage: colibri", shown), shown
    for values in (kernels.ACTIVATIONS, KV_CACHES, SPLITS, (*DRAFT_MODES, "NAME"), ("lfu_aging", "lru", "lfu", "NAME")):
        assert f"<{'|'.join(values)}>" in shown, values
    assert "(needs colibri[ray])" in shown and "{prompt}" not in shown
    convert = CliRunner().invoke(app, ["convert", "--help"]).output
    assert "<f32|int8|int4>" in convert


def test_shell_completion_is_offered_and_completes():
    script = Path(sys.executable).with_name("colibri")  # the console script: completion is keyed on its name
    # --show-completion names the shell it is run from (typer asks shellingham, which walks the parent
    # processes): run it from bash, whatever runs the tests (`; exit`: bash would exec a lone command)
    r = subprocess.run(["bash", "-c", f"'{script}' --show-completion; exit $?"], capture_output=True, text=True)
    assert r.returncode == 0 and "_COLIBRI_COMPLETE=complete_bash" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([script], capture_output=True, text=True,
                       env={**os.environ, "_COLIBRI_COMPLETE": "complete_bash", "COMP_WORDS": "colibri ser",
                            "COMP_CWORD": "1"})
    assert r.stdout.split() == ["serve"], r.stdout + r.stderr
    r = subprocess.run([script], capture_output=True, text=True,
                       env={**os.environ, "_COLIBRI_COMPLETE": "complete_bash", "COMP_WORDS": "colibri run --sys",
                            "COMP_CWORD": "2"})
    assert r.stdout.split() == ["--system"], r.stdout + r.stderr


# ---- what is shown on stderr --------------------------------------------------------------------------
STATS = re.compile(r"^\[\d+ tokens · [\d.]+ tok/s · prefill (\d+) tokens at ([\d.]+) tok/s · TTFT [\d.]+ s · ", re.M)


def test_stats_line_has_the_prefill_speed(env):
    r = colibri("run", "--max-tokens", "3", PROMPT, env=env)
    m = STATS.search(r.stderr)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, r.stderr


def test_verbose_quiet_and_colibri_log(env):
    """-q: the answer and nothing else; -v (or COLIBRI_LOG=info): the loading line and where state is
    kept, even off a terminal; a pipe without them: no loading line; a wrong COLIBRI_LOG is one line."""
    plain = colibri("run", "--max-tokens", "5000", PROMPT, env=env)
    quiet = colibri("-q", "run", "--max-tokens", "5000", PROMPT, env=env)
    assert quiet.returncode == 0 and quiet.stdout == plain.stdout and quiet.stderr == "", quiet.stderr
    assert "loading" not in plain.stderr and STATS.search(plain.stderr)
    demo_state = Path(env["XDG_STATE_HOME"]) / "colibri" / "colibri-demo-kjv"
    for r in (colibri("-v", "run", "--max-tokens", "3", PROMPT, env=env),
              colibri("run", "--max-tokens", "3", PROMPT, env={**env, "COLIBRI_LOG": "info"})):
        lines = r.stderr.splitlines()
        assert lines[0] == "colibri: loading colibri-demo-kjv", r.stderr
        assert f"colibri: state directory (sessions, prefix cache, routing history): {demo_state}" in lines
        assert any(re.fullmatch(r"colibri: loaded colibri-demo-kjv \(olmoe, [\d.]+ [KM]B resident\) in [\d.]+ s, "
                                r"[\d.]+ [KM]?B read", line) for line in lines), r.stderr
        assert STATS.search(r.stderr)
    one_line_error(colibri("run", PROMPT, env={**env, "COLIBRI_LOG": "loud"}),
                   "COLIBRI_LOG must be one of debug, info, warning, error, got 'loud'")
    one_line_error(colibri("-v", "-q", "run", PROMPT, env=env), "give -v or -q, not both")


def test_loading_line_on_a_terminal(env):
    """stderr on a terminal: the loading line, which ends saying what was loaded."""
    primary, secondary = pty.openpty()
    try:
        r = subprocess.run([*COLIBRI, "run", "--max-tokens", "3", PROMPT], stdout=subprocess.PIPE, stderr=secondary,
                           env=env, timeout=120)
        os.close(secondary)
        secondary = None
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the terminal's other end is closed and everything was read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
        if secondary is not None:
            os.close(secondary)
    assert r.returncode == 0
    assert re.search(rb"colibri: loaded colibri-demo-kjv \(olmoe, [\d.]+ [KM]B resident\) in [\d.]+ s", shown), shown


# ---- where state is kept ------------------------------------------------------------------------------
def test_state_dir_holds_sessions_and_history(tiny_model, env, tmp_path):
    """--state-dir DIR: sessions, the routing history and the prefix cache's spill go there, and
    nothing is written beside the model."""
    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    before = snapshot(d)
    state = tmp_path / "elsewhere"
    r = colibri("run", "--model", d, "--state-dir", state, "--session", "s", "--max-tokens", "3", "fox", env=env)
    assert r.returncode == 0, r.stderr
    assert (state / ".sessions" / "s.coli_session").is_file() and (state / ".coli_usage").is_file()
    assert snapshot(d) == before


def test_a_checkpoint_run_as_it_is_is_never_written_to(tiny_checkpoint, env, tmp_path):
    """A Hugging Face directory run as it is: its routing history and sessions go to the per-user
    state directory (it wrote .coli_usage into the checkpoint)."""
    from colibri_core.statedir import user_state_dir

    d = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint, d)
    before = snapshot(d)
    r = colibri("run", "--model", d, "--session", "s", "--max-tokens", "3", "fox", env=env)
    assert r.returncode == 0, r.stderr
    assert snapshot(d) == before
    state = Path(env["XDG_STATE_HOME"]) / "colibri" / f"hf-{user_state_dir(d).name.rsplit('-', 1)[1]}"
    assert (state / ".coli_usage").is_file() and (state / ".sessions" / "s.coli_session").is_file()


def test_sessions_work_on_a_read_only_model_directory(tiny_model, env, tmp_path):
    """A converted model on a read-only mount: its sessions and history go to the per-user state
    directory (the session was refused)."""
    d = tmp_path / "m"
    shutil.copytree(tiny_model, d)
    if not can_mount_read_only(d):
        pytest.skip("this machine does not let unshare -rm mount a directory read-only")
    chat = ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(d),
            *COLIBRI, "chat", "--model", str(d), "--session", "s", "--max-tokens", "3"]
    for turn in ("fox", "dog"):
        r = subprocess.run(chat, capture_output=True, text=True, input=f"{turn}\n/exit\n", env=env)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "(resumed session s: 2 messages" in r.stderr, r.stderr
    states = list((Path(env["XDG_STATE_HOME"]) / "colibri").glob("m-*/.sessions/s.coli_session"))
    assert len(states) == 1 and not (d / ".sessions").exists()
