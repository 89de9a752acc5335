"""The `colibri` command line. Every command's help is its docstring; a user error is one line on
stderr and exit status 1. Heavy modules are imported inside the commands that need them."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import typer

from .demo import demo_model
from .errors import ColibriError
from .options import EngineOptions, cli_option, command_options, ray_paths
from .plugins import SHIPPED_PLUGINS

# help is printed as written (rich_markup_mode=None: "colibri[ray]" is no markup tag to drop);
# --install-completion / --show-completion are typer's shell completion (README)
app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Run Mixture-of-Experts language models larger than RAM, streaming experts from disk.")
log = logging.getLogger("colibri")
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _print_version(value: bool) -> None:
    if value:
        from . import plugins

        print(plugins.versions_text())
        raise typer.Exit()


class _LogFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"colibri: {level}{record.getMessage()}"


def _logging(verbose: int, quiet: bool) -> None:
    """The `colibri` logger's level, which says what the commands show on stderr: -q errors only (no
    stats line, no loading line, no notes), -v info (the loading line off a terminal too, where the
    state directory is), -vv debug; without either COLIBRI_LOG (debug, info, warning, error), else warning."""
    if quiet and verbose:
        raise ColibriError("give -v or -q, not both")
    name = os.environ.get("COLIBRI_LOG", "").strip().lower() or "warning"
    if name not in LOG_LEVELS:
        raise ColibriError(f"COLIBRI_LOG must be one of {', '.join(LOG_LEVELS)}, got {name!r}")
    level = logging.ERROR if quiet else {0: LOG_LEVELS[name], 1: logging.INFO}.get(verbose, logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)  # this invocation's stderr (a test runner swaps it)
    handler.setFormatter(_LogFormat())
    log.handlers = [handler]
    log.setLevel(level)
    log.propagate = False


def _note(message: str) -> None:
    """One `colibri: note:` line on stderr (none under -q)."""
    if log.isEnabledFor(logging.WARNING):
        print(f"colibri: note: {message}", file=sys.stderr)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                          help="Print colibri's version and every installed plugin's, then exit."),
             verbose: int = typer.Option(0, "--verbose", "-v", count=True, show_default=False, help="Say more on "
                                         "stderr: the loading line also off a terminal, where state is kept (-vv: "
                                         "debug). COLIBRI_LOG=debug|info|warning|error sets the same."),
             quiet: bool = typer.Option(False, "--quiet", "-q", help="Only the answer and errors: no stats line, "
                                        "loading line or notes.")):
    """Run Mixture-of-Experts language models larger than RAM, streaming experts from disk."""
    _logging(verbose, quiet)

ModelOpt = typer.Option(None, "--model", "-m", envvar="COLIBRI_MODEL", help="Converted model directory, a checkpoint run as it is, or a pulled model's hub id ORG/NAME (default: the bundled demo model).")
SeedOpt = typer.Option(None, "--seed", min=-1, callback=lambda seed: None if seed == -1 else seed,
                       help="Seed for sampling (-1: random, as without one).")
StatsOpt = typer.Option(False, "--stats", help="After the stats line, print every expert-store counter.")
# sampling beyond temperature / top-p / top-k (generate.py: Sampling), as vLLM and llama.cpp name it
MinPOpt = typer.Option(0.0, "--min-p", help="Only tokens at least this fraction as likely as the most likely one (0: off).")
PresenceOpt = typer.Option(0.0, "--presence-penalty", help="Subtracted from the logit of every token the answer holds.")
FrequencyOpt = typer.Option(0.0, "--frequency-penalty", help="Subtracted from a token's logit once per time the answer holds it.")
RepetitionOpt = typer.Option(1.0, "--repetition-penalty", "--repeat-penalty", help="A token of the prompt or answer has its logit divided by it (if positive) or multiplied (1: off).")
RepeatLastNOpt = typer.Option(None, "--repeat-last-n", min=-1, help="llama.cpp's window: every penalty counts only the last N tokens of prompt and answer (-1: all; 0: no penalty; absent: presence and frequency count the answer, repetition both).")
LogitBiasOpt = typer.Option(None, "--logit-bias", metavar="ID=BIAS", help="Add BIAS to token ID's logit (repeatable; -inf bans it; llama.cpp's ID+BIAS / ID-BIAS too).")
GrammarOpt = typer.Option(None, "--grammar", help="A grammar file the answer follows: Lark (llguidance's dialect) or GBNF (llama.cpp's), by extension (.lark, .gbnf) or content.")
JsonSchemaOpt = typer.Option(None, "--json-schema", help="A JSON schema file: the answer is JSON valid against it.")
SystemOpt = typer.Option(None, "--system", metavar="<text>", help="A system message before the conversation "
                         "(with the chat template; a model without one: a first line of text).")
StopOpt = typer.Option(None, "--stop", metavar="<text>", help="End the answer where this text appears (it is not "
                       "printed); repeat for several.")
DraftOpt = typer.Option("auto", "--draft", metavar="<auto|mtp|grammar|off|NAME>", help="Speculative decoding: auto (a grammar's forced tokens, and the model's MTP head while it pays), mtp, grammar, off, or a drafter a plugin registers. Never changes a greedy token.")
# `plan` and `doctor` take a few of the engine's options alone (every command that loads a model takes
# them all: `command_options`)
RamOpt, PinOpt, KvCacheOpt, RaySplitOpt, RayModelOpt = map(cli_option, ("ram", "pin_gb", "kv_cache", "ray_split",
                                                                        "ray_models"))

# The trained demo model shipped inside the colibri distribution (colibri_core/demo, found through
# importlib.resources; see README): the default without --model.
DEFAULT_MODEL = demo_model()


def _model_dir(model: Optional[Path]) -> Path:
    """--model as a directory: a path as it is, a hub id ORG/NAME as the model pulled from it."""
    if model is not None:
        from . import hub

        return hub.resolve(model)
    if (DEFAULT_MODEL / "colibri.yaml").is_file():
        return DEFAULT_MODEL
    raise ColibriError(f"no model given: pass --model DIR or set COLIBRI_MODEL (the bundled demo model is "
                       f"missing from {DEFAULT_MODEL}: reinstall colibri)")


def _open(model: Optional[Path], options: EngineOptions):
    """The engine of `model`, loaded with the loading line (progress.py) on stderr."""
    from .engine import load
    from .progress import Loading

    model_dir = _model_dir(model)
    with Loading(model_dir) as loading:
        engine = load(model_dir, options)
        loading.done(engine)
    return engine


def _structure(engine, grammar: Optional[Path], json_schema: Optional[Path]):
    """A maker of fresh constraints for --grammar / --json-schema (one per answer), or None; the file
    is compiled here, once, so a grammar that cannot be compiled is one line before any generation."""
    if grammar is None and json_schema is None:
        return None
    if grammar is not None and json_schema is not None:
        raise ColibriError("give --grammar or --json-schema, not both")
    from .structured import Constraint, Vocabulary

    vocab = Vocabulary.of(engine)
    path, kind = (grammar, "grammar") if grammar is not None else (json_schema, "json_schema")
    Constraint.from_file(vocab, path, kind)
    return lambda: Constraint.from_file(vocab, path, kind)


def store_report(engine) -> str:
    """Every expert-store counter, a few lines (`run --stats`, `chat` /stats)."""
    from .sizes import format_bytes

    s = engine.stats()
    layers = " ".join(f"{layer}:{100 * r:.0f}%" for layer, r in s["layer_hit_rate"].items())
    stalls = " ".join(f"{layer}:{1e3 * t:.0f}" for layer, t in s["layer_io_stall_seconds"].items())
    stripe = f"{s['stripe']} ({100 * s['stripe_share']:.0f}% of experts)" if s["stripe"] else "off"
    # per disk read from (the model's "primary", its "stripe" directory, a "mirror"): its bytes and the
    # summed time of its reads (the I/O threads read several at once: not wall time)
    disks = "".join(f"disk {d}: {format_bytes(c['bytes'])} in {c['reads']} reads, {c['read_seconds']:.3f} s "
                    f"reading ({format_bytes(c['bytes'] / max(c['read_seconds'], 1e-9))}/s a thread)\n"
                    for d, c in s["disks"].items())
    return (f"expert_hits {s['expert_hits']} · expert_misses {s['expert_misses']} · bytes_read "
            f"{format_bytes(s['bytes_read'])} ({s['reads']} reads) · prefetch_issued {s['prefetch_issued']} · "
            f"prefetch_used {s['prefetch_used']} · prefetch_skipped {s['prefetch_skipped']} · "
            f"prefetch_recall {100 * s['prefetch_recall']:.1f}% · "
            f"io_stall_seconds {s['io_stall_seconds']:.3f}\n"
            f"lookahead depth {s['lookahead_depth']}: " + (" · ".join(
                f"distance {d} issued {c['issued']} used {c['used']} skipped {c['skipped']} recall {100 * c['recall']:.0f}%"
                for d, c in s["prefetch_by_distance"].items()) or "off") + "\n"
            f"cache {s['cache_slots_per_layer']} slots/layer ({s['policy']}), {s['transient_reads']} reads past them · pinned {s['pinned_experts']} experts "
            f"({format_bytes(s['pinned_bytes'])}) · direct I/O {'on' if s['direct_io'] else 'off'} · mirror "
            f"{s['mirror'] if s['mirror_in_use'] else 'off'} · stripe {stripe} · history {s['history_tokens']} tokens · "
            f"activations {s['activations']} · KV cache {s['kv_cache']}\n"
            f"per-layer hit rate {layers}\n"
            f"per-layer I/O stall (ms) {stalls}\n"
            f"{disks}"
            f"drafts {s['draft_drafted']} · accepted {s['draft_accepted']} ({100 * s['draft_acceptance']:.0f}%) · "
            f"forced tokens {s['draft_forced_tokens']} · tokens per forward {s['tokens_per_forward']:.2f}\n"
            f"prefix cache {s['prefix_cache_entries']} entries ({format_bytes(s['prefix_cache_bytes'])} of "
            f"{format_bytes(s['prefix_cache_budget'])}) · hits {s['prefix_cache_hits']} ({s['prefix_cache_disk_hits']} "
            f"from disk) · cached tokens {s['prefix_cached_tokens']} of {s['prompt_tokens']} prompt tokens")


def remote_report(engine) -> str:
    """The remote shards' counters and each shard's state, a few lines (`run --stats --ray`)."""
    from .sizes import format_bytes

    s = engine.stats()
    answered = s["remote_latency"]["count"]
    lines = [f"remote ({s['remote_split']} split): {s['remote_shards_up']}/{s['remote_shards']} shards up · "
             f"calls {s['remote_calls']} ({s['remote_calls'] / max(1, s['generated_tokens']):.1f}/token) · "
             f"mean latency {1e3 * s['remote_seconds'] / max(1, answered):.2f} ms · sent "
             f"{format_bytes(s['remote_bytes_sent'])} · received {format_bytes(s['remote_bytes_received'])} · "
             f"failures {s['remote_failures']} (timeouts {s['remote_timeouts']}) · rejoins {s['remote_rejoins']} · "
             f"experts computed locally after a failure {s['remote_fallback_experts']}"]
    for r in s["remote_shard_table"].values():
        lines.append(f"  shard {r['shard']} on {r['address']} ({r['node'][:8]}): {r['state']}, {r['experts']} experts "
                     f"({format_bytes(r['bytes'])}), {r['calls']} calls" + (f", last error: {r['last_error']}"
                                                                            if r["last_error"] else ""))
    return "\n".join(lines)


def stats_line(engine, seconds: float, before: dict | None = None) -> str:
    """Tokens, decode speed, prefill speed, time to first token, time, expert hits and bytes read: of
    the engine's life, or since `before` (an earlier `engine.stats()`: one chat turn); then the peak RSS."""
    from .sizes import format_bytes

    s = engine.stats()
    d = {k: s[k] - (before or {}).get(k, 0) for k in ("generated_tokens", "decode_seconds", "expert_hits",
                                                      "expert_misses", "bytes_read", "prompt_tokens",
                                                      "prefill_seconds")}
    tps = max(0, d["generated_tokens"] - 1) / d["decode_seconds"] if d["decode_seconds"] else 0.0
    prefill = d["prompt_tokens"] / d["prefill_seconds"] if d["prefill_seconds"] else 0.0
    lookups = d["expert_hits"] + d["expert_misses"]
    return (f"[{d['generated_tokens']} tokens · {tps:.1f} tok/s · prefill {d['prompt_tokens']} tokens at "
            f"{prefill:.1f} tok/s · TTFT {s['time_to_first_token']:.2f} s · {seconds:.2f} s total · "
            f"expert hit rate {100 * d['expert_hits'] / max(1, lookups):.1f}% ({d['expert_hits']} hits, "
            f"{d['expert_misses']} misses) · read {format_bytes(d['bytes_read'])} · "
            f"peak RSS {format_bytes(s['peak_rss_bytes'])}]")


def _knobs(min_p: float, presence: float, frequency: float, repetition: float, repeat_last_n: Optional[int],
           logit_bias: Optional[list[str]]) -> dict:
    """`Engine.stream`'s keywords for the sampling options beyond temperature / top-p / top-k."""
    import re

    bias = {}
    for item in logit_bias or ():
        m = re.fullmatch(r"\s*(\d+)\s*(?:=|(?=[+-]))\s*([+-]?[^\s+-]+)\s*", item)  # ID=BIAS, ID+BIAS, ID-BIAS
        try:
            bias[int(m.group(1))] = float(m.group(2))
        except (AttributeError, ValueError):  # no match, or no number
            raise ColibriError(f"--logit-bias {item!r}: give TOKEN_ID=BIAS (e.g. 15043=-inf or 15043=2.5)") from None
    return {"min_p": min_p, "presence_penalty": presence, "frequency_penalty": frequency,
            "repetition_penalty": repetition, "logit_bias": bias,
            "penalty_last_n": None if repeat_last_n is None else (1 << 31) - 1 if repeat_last_n == -1 else repeat_last_n}


def _room(engine, n_tokens: int, max_tokens: int) -> int:
    """`max_tokens`, cut to what the model's context leaves after `n_tokens` (the server refuses what
    does not fit; here the answer just ends there); a ColibriError when the prompt leaves no room."""
    ctx = engine.context_length
    if ctx is None:
        return max_tokens
    if n_tokens >= ctx:
        raise ColibriError(f"the prompt is {n_tokens} tokens; this model's context is {ctx}")
    return min(max_tokens, ctx - n_tokens)


def _print_answer(tokens, out, answer: list[int]) -> tuple[str, str]:
    """Print each token's text (`out`, a server.text.TextStream) as the engine yields it, keeping the
    tokens in `answer`, until the answer ends or a --stop string appears (it ends before it); the
    stream is closed then. Returns the whole text and its held-back tail, which the caller prints
    once the turn is recorded."""
    shown = []
    try:
        for token in tokens:
            answer.append(token)
            shown.append(out.push(token))
            sys.stdout.write(shown[-1])
            sys.stdout.flush()
            if out.stopped:
                break
    finally:
        tokens.close()
    tail = out.flush()
    return "".join(shown) + tail, tail


def _context_note(engine, n_tokens: int, answer: int, max_tokens: int) -> None:
    """One note when the model's context, not --max-tokens, ended an answer of `answer` tokens after a
    prompt of `n_tokens`."""
    room = _room(engine, n_tokens, max_tokens)
    if room < max_tokens and answer >= room:
        _note(f"the answer stopped at the model's context ({engine.context_length} tokens: {n_tokens} of prompt, "
              f"{answer} of answer), before --max-tokens {max_tokens}")


def _prompt_text(prompt: Optional[str]) -> str:
    """PROMPT, or for `-` (or no PROMPT while text is piped in) stdin's text, less one final newline
    (echo's, an editor's); a one-line ColibriError for no prompt at all or bytes that are not UTF-8."""
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise ColibriError("give a PROMPT, or - to read it from stdin (colibri run - < prompt.txt)")
    data = sys.stdin.buffer.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ColibriError(f"stdin is not valid UTF-8: {data[:60]!r}") from None
    return text[:-1] if text.endswith("\n") else text


class _Conversation:
    """Token ids of chat messages, after the --system message if any: the chat template's rendering
    with its generation prompt (special tokens typed in a message stay text, as the server keeps
    them), or for a model without a template the messages as lines of plain text."""

    def __init__(self, engine, system: Optional[str]):
        from .chat_template import ChatTemplate
        from .server.text import ChatText

        self.tokenizer = engine.tokenizer
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.template = ChatTemplate.from_dir(engine.model_dir)
        self.chat_text = None if self.template is None else ChatText(engine.tokenizer)

    def ids(self, messages: list[dict]) -> list[int]:
        messages = self.system + messages
        if self.template is None:
            return self.tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")
        return self.chat_text.encode(self.template.render(self.chat_text.mask(messages)))


@app.command()
@command_options
def run(
    prompt: Optional[str] = typer.Argument(None, metavar="PROMPT", help="The prompt text; - (or none, with text "
                                           "piped in) reads it from stdin."),
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most new tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = no top-k cut."),
    seed: Optional[int] = SeedOpt,
    min_p: float = MinPOpt,
    presence_penalty: float = PresenceOpt,
    frequency_penalty: float = FrequencyOpt,
    repetition_penalty: float = RepetitionOpt,
    repeat_last_n: Optional[int] = RepeatLastNOpt,
    logit_bias: Optional[list[str]] = LogitBiasOpt,
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template as a user turn."),
    system: Optional[str] = SystemOpt,
    stop: Optional[list[str]] = StopOpt,
    session_name: Optional[str] = typer.Option(None, "--session", metavar="<name>", help="One chat turn of the "
                                               "conversation saved as NAME (as chat --session keeps it: either "
                                               "resumes it): PROMPT is the next user message."),
    stats: bool = StatsOpt,
    draft: str = DraftOpt,
    grammar: Optional[Path] = GrammarOpt,
    json_schema: Optional[Path] = JsonSchemaOpt,
    *, options: EngineOptions,  # every engine option (colibri_core/options.py): command_options
):
    """Generate a completion of PROMPT (-, or text piped in: stdin's), print it, then one stats line
    (--stats: every store counter). With --chat, --system or --session PROMPT is a user message in
    the model's chat template."""
    from .server.text import TextStream

    text = _prompt_text(prompt)
    knobs = _knobs(min_p, presence_penalty, frequency_penalty, repetition_penalty, repeat_last_n, logit_bias)
    t0 = time.perf_counter()
    engine = _open(model, options)
    with engine:
        session, messages = _open_saved(engine, session_name) if session_name is not None else (None, [])
        if chat or system is not None or session is not None:
            conversation = _Conversation(engine, system)
            if chat and conversation.template is None:
                raise ColibriError(f"{engine.model_dir}: --chat needs a chat template, and this model has none")
            messages.append({"role": "user", "content": text})
            ids = conversation.ids(messages)
        else:
            ids = engine.tokenizer.encode(text)
        make = _structure(engine, grammar, json_schema)
        room = _room(engine, len(ids), max_tokens)
        out, answer = TextStream(engine.tokenizer, stop or []), []
        # a session's turn is one record: the state the answer leaves and the messages with the answer
        with session.turn() if session is not None else contextlib.nullcontext():
            tokens = engine.stream(ids, room, temperature, top_p, top_k, seed, session=session, draft=draft,
                                   constraint=make and make(), **knobs)
            text, tail = _print_answer(tokens, out, answer)
            if session is not None:
                messages.append({"role": "assistant", "content": text})
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        if not out.stopped:
            _context_note(engine, len(ids), len(answer), max_tokens)
        if log.isEnabledFor(logging.WARNING):
            print(stats_line(engine, time.perf_counter() - t0), file=sys.stderr)
        if stats:
            print(store_report(engine), file=sys.stderr)
            if engine.experts.remote is not None:
                print(remote_report(engine), file=sys.stderr)


def _saved_messages(session, name: str) -> list:
    """The resumed session's chat messages (a list kept in its meta, saved with every turn, answer
    included). A question saved without its answer (by a colibri that wrote a turn as two records,
    killed between them) is dropped, and the conversation resumes at the turn before, with a note;
    messages that are no conversation start it over."""
    messages = session.meta.setdefault("messages", [])
    if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in messages)):
        print(f"colibri: note: session {name}: the saved messages are unreadable; starting the conversation over",
              file=sys.stderr)
        session.reset()
        return session.meta.setdefault("messages", [])
    if messages and messages[-1]["role"] == "user":
        while messages and messages[-1]["role"] == "user":
            messages.pop()
        print(f"colibri: note: session {name}: the last question was saved without its answer (an interrupted "
              f"save); resuming at the turn before it", file=sys.stderr)
    return messages


def _open_saved(engine, name: str):
    """Saved session `name` and its chat messages, resumed (`chat --session`, `run --session`); a
    one-line ColibriError before any answer if it cannot be saved."""
    from .kv.session import SessionWarning

    _check_saveable(engine, name)  # before the first answer, not after it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SessionWarning)  # printed below as one line
        session = engine.open_session(name)
    if session.notice:
        _note(session.notice)
    messages = _saved_messages(session, name)
    if messages and log.isEnabledFor(logging.WARNING):
        print(f"(resumed session {name}: {len(messages)} messages, {len(session.ids)} tokens)", file=sys.stderr)
    return session, messages


def _check_saveable(engine, name: str) -> None:
    """A one-line ColibriError unless session `name` can be saved: its directory is made (if missing)
    and a nameless file tried in it, as permission bits cannot tell (root ignores them; a read-only
    mount or a file in the directory's place does not show in them)."""
    from .kv.session import session_path

    directory = session_path(engine.sessions_dir, name).parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        raise ColibriError(f"cannot save session {name} in {directory}: {e.strerror or e}") from None


@app.command()
@command_options
def chat(
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(512, "--max-tokens", help="Most new tokens per answer."),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.95, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = SeedOpt,
    min_p: float = MinPOpt,
    presence_penalty: float = PresenceOpt,
    frequency_penalty: float = FrequencyOpt,
    repetition_penalty: float = RepetitionOpt,
    repeat_last_n: Optional[int] = RepeatLastNOpt,
    logit_bias: Optional[list[str]] = LogitBiasOpt,
    draft: str = DraftOpt,
    grammar: Optional[Path] = GrammarOpt,
    json_schema: Optional[Path] = JsonSchemaOpt,
    system: Optional[str] = SystemOpt,
    stop: Optional[list[str]] = StopOpt,
    session_name: Optional[str] = typer.Option(None, "--session", help="Save the conversation as NAME in the "
                                               "state directory (--state-dir) after every turn and resume it when "
                                               "started again."),
    *, options: EngineOptions,  # every engine option (colibri_core/options.py): command_options
):
    """Chat interactively, streaming tokens. Commands: /reset, /stats, /exit."""
    from .server.text import TextStream

    knobs = _knobs(min_p, presence_penalty, frequency_penalty, repetition_penalty, repeat_last_n, logit_bias)
    engine = _open(model, options)
    with engine:  # closed at the end: its session locks released, its I/O threads stopped
        conversation = _Conversation(engine, system)
        make = _structure(engine, grammar, json_schema)  # each answer follows it
        session, messages = engine.new_session(), []
        if session_name is not None:
            session, messages = _open_saved(engine, session_name)
        print(f"colibri chat · {engine.model_dir} · /reset /stats /exit", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return
            if line.strip() in ("/exit", "/quit"):
                return
            if line.strip() == "/reset":
                if session_name is not None:
                    session.reset()
                    messages = session.meta.setdefault("messages", [])
                    session.save()
                else:
                    session, messages = engine.new_session(), []
                print("(conversation reset)", file=sys.stderr)
                continue
            if line.strip() == "/stats":
                print(store_report(engine), file=sys.stderr)
                if engine.experts.remote is not None:
                    print(remote_report(engine), file=sys.stderr)
                continue
            if not line.strip():
                continue
            try:
                _check_utf8(line, "this line")
            except ColibriError as e:  # a typo, not the end of the chat
                print(f"colibri: error: {e}", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            ids = conversation.ids(messages)
            try:
                room = _room(engine, len(ids), max_tokens)
            except ColibriError as e:  # the conversation outgrew the context: this question is not asked
                messages.pop()
                print(f"colibri: error: {e}; /reset starts over", file=sys.stderr)
                continue
            out, answer = TextStream(engine.tokenizer, stop or []), []
            t0, before = time.perf_counter(), engine.stats()
            # one turn, one record: the state the answer leaves and the messages with the answer together
            turn = session.turn() if session_name is not None else contextlib.nullcontext()
            try:
                with turn:  # an answer cut short ends inside the turn (which then saves nothing)
                    tokens = engine.stream(ids, room, temperature, top_p, top_k, seed, session=session,
                                           draft=draft, constraint=make and make(), **knobs)
                    text, tail = _print_answer(tokens, out, answer)
                    messages.append({"role": "assistant", "content": text})
            except KeyboardInterrupt:  # Ctrl-C stops the answer, not the chat: the turn never happened
                messages.pop()
                print("\n(interrupted: the question and its partial answer are forgotten)", file=sys.stderr)
                continue
            print(tail)
            if not out.stopped:
                _context_note(engine, len(ids), len(answer), max_tokens)
            if log.isEnabledFor(logging.WARNING):
                print(stats_line(engine, time.perf_counter() - t0, before), file=sys.stderr)


@app.command()
@command_options
def atlas(
    model: Optional[Path] = ModelOpt,
    prompts: Optional[Path] = typer.Option(None, "--prompts", help='A prompt set, JSON {"prompts": [{"topic", "text", '
                                           '"source"}, …]} (default: the one shipped for the model: colibri_core/atlas_prompts).'),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="Greedy tokens generated after each prompt."),
    restart: bool = typer.Option(False, "--restart", help="Characterise anew, not continuing the saved atlas."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the placement's jitter (the layout is the same for a seed)."),
    json_out: bool = typer.Option(False, "--json", help="Print the atlas as JSON: per expert its layer, index, 3D "
                                  "position, topic shares, heat and tier (as GET /api/atlas)."),
    *, options: EngineOptions,  # every engine option (colibri_core/options.py): command_options
):
    """Characterise every expert by the topics that route to it: run a topic-labelled prompt set
    through the model (greedy, a bounded number of tokens each) and count each expert's routing per
    topic. Saved after every prompt in .coli_atlas in the state directory, so a run stopped midway is
    continued by the next; the routing history (.coli_usage) adds a "your workload" topic. Then
    prints the clusters (or --json, the whole atlas) and the store's counters; `colibri web` draws it."""
    from dataclasses import replace

    from . import atlas as atlas_mod
    from .store.usage import USAGE_FILE, UsageHistory

    model_dir = _model_dir(model)
    prompt_set = atlas_mod.read_prompts(prompts or atlas_mod.default_prompts(model_dir))
    # the atlas's prompts are not the user's workload: they are not counted into .coli_usage
    engine = _open(model, replace(options, usage=False))
    with engine:
        path = engine.sessions_dir / atlas_mod.ATLAS_FILE
        quiet = not log.isEnabledFor(logging.WARNING)
        with typer.progressbar(length=len(prompt_set), label="characterising", file=sys.stderr, hidden=quiet) as bar:
            atlas = atlas_mod.characterise(engine, prompt_set, path, max_tokens, restart,
                                           on_prompt=lambda p, counted: bar.update(1), warn=_note)
        history = UsageHistory(engine.container, engine.sessions_dir / USAGE_FILE)
        atlas_mod.add_workload(atlas, history.counts, history.tokens)
        atlas.save(path)
        placed = atlas_mod.place(atlas, seed)
        placement, c = engine.store.placement(), engine.container
        tiers = atlas_mod.tier_codes(placement.cached, placement.pinned, c.moe_layers, c.n_experts)
        doc = atlas_mod.document(atlas, placed, tiers, history.counts,
                                 [c.layer_expert_nbytes(layer) for layer in c.moe_layers], engine.model_dir.name)
        if json_out:
            print(json.dumps(doc))
        else:
            print(f"atlas of {doc['model']}: {len(doc['experts'])} experts, {len(doc['topics'])} topics, "
                  f"{doc['prompts_done']} prompts of {max_tokens} tokens · {path}")
            for cl in sorted(doc["clusters"], key=lambda cl: -cl["experts"]):
                print(f"  {cl['topic']}: {cl['experts']} experts")
            print(f"  cross-layer hubs: {sum(e['shared'] for e in doc['experts'])} experts")
        if not quiet:
            print(store_report(engine), file=sys.stderr)


HostOpt = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; "
                       "then give an --api-key).")


def _port(port: int) -> int:
    if not 0 <= port <= 65535:  # the server listened on another port (99999: 34463)
        raise ColibriError(f"--port must be 0 (any free port) to 65535, got {port}")
    return port


PortOpt = typer.Option(8000, "--port", callback=_port, help="Port to listen on (0: any free port).")
ApiKeyOpt = typer.Option(None, "--api-key", envvar="COLIBRI_API_KEY",
                         help="Require 'Authorization: Bearer KEY' on every endpoint but /health (the dashboard "
                         "asks for it once). An empty key is an error.")
QueueOpt = typer.Option(16, "--queue", min=0, help="Requests that may wait behind the running ones; more get 429.")
NameOpt = typer.Option(None, "--model-name", help="Model id clients send (default: the model directory's name).")
OriginOpt = typer.Option(None, "--allow-origin", help="A web origin (scheme://host, :port if not the default) whose "
                         "pages may call the API (CORS); repeat for several; '*' for any. By default only the "
                         "server's own pages and non-browser clients are served.")
TrustedHostOpt = typer.Option(None, "--trusted-host", metavar="<host>", help="A host name the server answers to "
                              "besides loopback's, IP addresses and its own (the Host a reverse proxy in front passes "
                              "on: its public name); repeat for several; '*' for any. Others get 403 (DNS rebinding).")
MaxTokensOpt = typer.Option(None, "--max-tokens", min=1, help="Most tokens one request may generate "
                            "(default: the model's context).")
ParallelOpt = typer.Option(4, "--parallel", min=1, max=256, help="Requests decoded together (continuous "
                           "batching: one forward per step for all, each MoE layer reading the union of their "
                           "experts once; each request's tokens are those it gets alone).")


def _serve(dashboard: bool, model, host, port, api_key, queue, parallel, model_name, allow_origin, trusted_host,
           max_tokens, options: EngineOptions):
    import os

    from .server import ServerConfig, serve

    if api_key is None and "COLIBRI_API_KEY" in os.environ:  # set but empty: click treats it as unset
        api_key = os.environ["COLIBRI_API_KEY"]
    serve(ServerConfig(_model_dir(model), model_name=model_name, max_queue=queue, parallel=parallel, api_key=api_key,
                       dashboard=dashboard, allow_origins=tuple(allow_origin or ()),
                       trusted_hosts=tuple(trusted_host or ()), max_tokens=max_tokens,
                       engine=options),
          host=host, port=port)


@app.command()
@command_options
def serve(model: Optional[Path] = ModelOpt, host: str = HostOpt, port: int = PortOpt, api_key: Optional[str] = ApiKeyOpt,
          queue: int = QueueOpt, parallel: int = ParallelOpt, model_name: Optional[str] = NameOpt,
          allow_origin: Optional[list[str]] = OriginOpt, trusted_host: Optional[list[str]] = TrustedHostOpt,
          max_tokens: Optional[int] = MaxTokensOpt, *, options: EngineOptions):
    """Serve the model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
    /v1/models, /health, /tokenize, /detokenize, /metrics (Prometheus), /openapi.json."""
    _serve(False, model, host, port, api_key, queue, parallel, model_name, allow_origin, trusted_host, max_tokens,
           options)


@app.command()
@command_options
def web(model: Optional[Path] = ModelOpt, host: str = HostOpt, port: int = PortOpt, api_key: Optional[str] = ApiKeyOpt,
        queue: int = QueueOpt, parallel: int = ParallelOpt, model_name: Optional[str] = NameOpt,
        allow_origin: Optional[list[str]] = OriginOpt, trusted_host: Optional[list[str]] = TrustedHostOpt,
        max_tokens: Optional[int] = MaxTokensOpt, *, options: EngineOptions):
    """Serve the API and a live dashboard at / : chat, tok/s, time to first token, where the time
    goes, the RAM budget, hit rate over time, the Brain map of every expert (and, with --ray, the
    cluster's shards)."""
    _serve(True, model, host, port, api_key, queue, parallel, model_name, allow_origin, trusted_host, max_tokens,
           options)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json + safetensors), or a GGUF file (a split one's first part, -00001-of-0000N.gguf)."),
    dst: Path = typer.Argument(..., help="Container directory to create."),
    quant: str = typer.Option("int4", "--quant", "-q", metavar="<f32|int8|int4>", help="f32, int8 or int4 for weight matrices (routers and norms stay f32)."),
    stripe_dir: Optional[Path] = typer.Option(None, "--stripe", metavar="DIR2", help="Then stripe the experts across DST's disk and DIR2's (colibri stripe)."),
    share: str = typer.Option("auto", "--share", metavar="<auto|0.4>", help="With --stripe: the part of the experts in DIR2 (auto: by measured bandwidth)."),
):
    """Convert a Hugging Face checkpoint, or a GGUF file (dequantised and requantised: the error is
    reported), into a colibri container (resumable, published atomically); --stripe DIR2 then
    stripes its experts across two disks (`colibri stripe`)."""
    from .convert import convert_checkpoint

    if src.suffix == ".gguf" and src.is_file():
        from .gguf_in import convert_gguf, parts_of

        arch, errors = convert_gguf(parts_of(src), dst, quant)
        for kind, e in errors.items():
            print(f"requantised {e['tensors']} {kind} tensors to {quant}: relative RMS error mean "
                  f"{e['mean_rel_rms']:.2e}, max {e['max_rel_rms']:.2e}", file=sys.stderr)
    else:
        arch = convert_checkpoint(src, dst, quant)
    print(f"converted {src} → {dst} ({arch.name}, {quant})", file=sys.stderr)
    if stripe_dir is not None:
        stripe(dst, stripe_dir, share, undo=False)


@app.command()
def stripe(
    model: Path = typer.Argument(..., help="Converted model directory."),
    directory: Optional[Path] = typer.Argument(None, help="A directory on another disk to move a share of the experts into."),
    share: str = typer.Option("auto", "--share", metavar="<auto|0.4>", help="The part of each layer's experts moved: "
                              "auto (in proportion to the two disks' measured bandwidths) or a number between 0 and 1."),
    undo: bool = typer.Option(False, "--undo", help="Bring every striped expert back into the model directory."),
):
    """Stripe a model's experts across two disks, each expert read from the disk that holds it, both
    disks reading at once (no doubled space, unlike --mirror). Moves a share of every layer's experts
    to DIR2 a layer at a time, each copy checked before the original's space is freed; crash-safe
    and resumable (rerun it); --undo brings them back. Refused while an engine has the model open."""
    from . import planning
    from .container import Container
    from .store import stripe as stripe_mod

    if not undo and directory is None:
        raise ColibriError("name the directory to stripe into (colibri stripe MODEL DIR2), or pass --undo")
    if share != "auto":
        try:
            share = float(share)
        except ValueError:
            raise ColibriError(f"--share must be auto or a number between 0 and 1, got {share!r}") from None
    with Container(model) as c:
        layers = len(c.moe_layers)
    label = f"moving {model}'s experts " + ("back" if undo else f"into {directory}")
    with typer.progressbar(length=layers, label=label, file=sys.stderr) as bar:
        step = lambda layer: bar.update(1)  # noqa: E731  one layer moved
        done = stripe_mod.unstripe(model, step) if undo else \
            stripe_mod.stripe(model, directory, share, step, measure=planning.stripe_share)
    if undo:
        print(f"{model}: every expert is back in the model directory", file=sys.stderr)
        return
    with Container(model) as c:
        print(f"{model}: {stripe_mod.summary(c, done)}", file=sys.stderr)


@app.command()
def pull(
    model: str = typer.Argument(..., help="A hub id, ORG/NAME or ORG/NAME@REVISION (a branch, tag or commit); ORG/NAME:QUANT picks a GGUF repository's file by its quantisation (Q4_K_M, Q8_0, …; case-insensitive)."),
    quant: str = typer.Option("int4", "--quant", "-q", help="int4, int8, f32, or native (the checkpoint kept as it is, run without conversion)."),
    keep_source: bool = typer.Option(False, "--keep-source", help="Keep the downloaded shards in the hub cache."),
    as_json: bool = typer.Option(False, "--json", help="Print the pull's figures as JSON."),
):
    """Download a model from the hub (huggingface_hub: HF_TOKEN, HF_ENDPOINT, its cache) and convert
    it shard by shard as it lands, deleting each shard once written: peak disk is the container plus
    about one shard. Resumable after a kill; `run --model ORG/NAME` then finds it. A GGUF
    repository (ORG/NAME:Q4_K_M, as llama.cpp's -hf) is downloaded whole, then converted."""
    from . import hub

    path, figures = hub.pull(model, quant, keep_source)
    print(json.dumps({"path": str(path), **figures}) if as_json else f"pulled {model} → {path}")


@app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """List the pulled models: hub id, revision, architecture, plugin, quantisation, size on disk."""
    from . import hub
    from .sizes import format_bytes

    models = hub.list_models()
    if as_json:
        print(json.dumps(models, indent=2))
        return
    for m in models:
        print(f"{m['id']:40} {(m['revision'] or '-')[:12]:12} {m['architecture'] or '-':14} {m['plugin'] or '-':18} "
              f"{m['quant'] or '-':6} {format_bytes(m['bytes']):>10}  {m['state']}"
              + (f", striped: {m['striped']}" if m.get("striped") else ""))


@app.command("rm")
def rm_cmd(model: str = typer.Argument(..., help="A pulled model's hub id, ORG/NAME.")):
    """Remove a pulled model (and any unfinished pull of it)."""
    from . import hub

    for path in hub.remove(model):
        print(f"removed {path}", file=sys.stderr)


@app.command("plugins")
def plugins_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """List colibri's version, then the installed plugins: name, version, the colibri versions each
    supports, hooks, and the architectures each serves with the config.json `architectures` and
    `model_type` values they answer to; plugins not loaded and why (imports no model code)."""
    from . import plugins

    registry = plugins.registry()
    rows = [{"name": p.distribution, "version": p.version, "requires_colibri": p.requires, "loaded": True,
             "error": None, "hooks": p.hooks, "architectures": [
                {"name": a.name, "hf_architectures": list(a.hf_architectures), "model_types": list(a.model_types),
                 "model": a.model} for a in map(registry.architectures.get, p.architectures)]}
            for p in registry.plugins.values()]
    metadata = {p.distribution: p for p in plugins.installed()}
    for name in registry.skipped:
        rows.append({"name": name, "version": metadata[name].version if name in metadata else "?",
                     "requires_colibri": metadata[name].requires if name in metadata else None, "loaded": False,
                     "error": "left out by COLIBRI_LOAD_PLUGINS", "hooks": [], "architectures": []})
    for name, (version, wanted, message) in registry.incompatible.items():
        rows.append({"name": name, "version": version, "requires_colibri": wanted, "loaded": False,
                     "error": message, "hooks": [], "architectures": []})
    rows.sort(key=lambda r: r["name"])
    if as_json:  # the core first, as a row of its own (its hooks: the cache policies it registers)
        core = {"name": "colibri", "version": plugins.core_version(), "requires_colibri": None, "loaded": True,
                "error": None, "hooks": ["colibri_register_cache_policies"], "architectures": []}
        print(json.dumps([core, *rows], indent=2))
        return
    print(f"colibri {plugins.core_version()}")
    if not rows:
        print("no plugins installed (colibri install colibri-olmoe)")
    for r in rows:
        supports = f"supports colibri {r['requires_colibri']}" if r["requires_colibri"] else "supports any colibri"
        if not r["loaded"]:
            print(f"{r['name']} {r['version']}: not loaded: "
                  + ("COLIBRI_LOAD_PLUGINS leaves it out" if r["error"].startswith("left out") else
                     f"{supports}, not this colibri {plugins.core_version()}"))
            continue
        print(f"{r['name']} {r['version']}: hooks {', '.join(r['hooks'])}; {supports}")
        for a in r["architectures"]:
            print(f"  {a['name']}: architectures {', '.join(a['hf_architectures']) or '-'}; "
                  f"model_type {', '.join(a['model_types']) or '-'}")


@app.command()
def install(
    target: str = typer.Argument(..., help="A plugin directory, a wheel, or the name of a plugin shipped with "
                                           f"colibri ({', '.join(SHIPPED_PLUGINS)})."),
    editable: bool = typer.Option(False, "--editable", "-e", help="Install a plugin directory in development "
                                  "mode (pip install -e): edits to its source count without reinstalling. The "
                                  "directory is built into a wheel and checked first, as without -e."),
):
    """Install a plugin with pip into colibri's own environment: a plugin directory, a wheel, or a
    shipped plugin by name (from its directory in a source checkout of colibri, else from pip's
    configured index and find-links). A directory is first built into a wheel in a throwaway
    directory (pip wheel, in an isolated build environment) and installed only if that wheel is a
    colibri plugin: nothing of a project that is none runs outside its build (with -e the checked
    directory is then installed editable, its build run once more, isolated too). This colibri is
    kept as it is: a plugin whose supported colibri versions leave it out is refused, never a reason
    to change colibri."""
    from . import plugins

    path = Path(target)
    if path.is_file():
        if editable:
            raise ColibriError(f"--editable needs a plugin directory (with a pyproject.toml), not {target}")
        plugins.check_wheel(path)  # a wheel that is no colibri plugin, or not for this colibri: one line
        _pip_install(target, [str(path.resolve())])
        return
    if not path.is_dir():
        if "/" in target or target.startswith(".") or target.endswith(".whl"):
            raise ColibriError(f"{target}: no such plugin directory or wheel")
        name = plugins.shipped_name(target)  # an unknown name: one line naming the shipped plugins
        path = plugins.shipped_plugin(name)
        if path is None:  # no checkout beside this colibri: from pip's index, which picks a version for it
            if editable:
                raise ColibriError(f"--editable needs a plugin directory: {name}'s source is not beside this "
                                   "colibri")
            _pip_install(name, [name])
            return
    if not any((path / f).is_file() for f in ("pyproject.toml", "setup.py")):
        raise ColibriError(f"{target}: not a plugin directory (it has no pyproject.toml)")
    path = path.resolve()
    plugins.check_plugin_dir(path)  # what its pyproject.toml tells, before anything of it runs: one line
    with tempfile.TemporaryDirectory(prefix="colibri-install-") as tmp:
        wheel = _build_wheel(path, Path(tmp))
        plugins.check_wheel(wheel, source=path)
        _pip_install(target, ["-e", str(path)] if editable else [str(wheel)])


def _build_wheel(directory: Path, into: Path) -> Path:
    """The wheel of the project in `directory`, built by pip into `into` in an isolated build
    environment (--use-pep517: a setup.py alone too, which pip would otherwise run in colibri's
    environment). pip's output is shown only when the build fails."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--use-pep517", "--wheel-dir", str(into),
                        str(directory)], capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if r.returncode or len(wheels) != 1:
        sys.stderr.write(r.stdout + r.stderr)
        raise ColibriError(f"pip could not build {directory} into a wheel (exit status {r.returncode})")
    return wheels[0]


def _pip_install(target: str, args: list[str]) -> None:
    """pip install `args` (plugin `target`) with colibri's own python, this colibri pinned beside them."""
    from . import plugins

    rc = subprocess.call([sys.executable, "-m", "pip", "install", *args, *plugins.core_pin()])
    if rc:
        raise ColibriError(f"pip could not install {target} (exit status {rc})")


@app.command()
def uninstall(name: str = typer.Argument(..., help="An installed plugin: its distribution or entry-point name "
                                                   "(as `colibri plugins` lists it).")):
    """Remove an installed plugin from colibri's own environment with pip."""
    from . import plugins

    dist = plugins.installed_name(name)  # not installed: one line naming those that are
    rc = subprocess.call([sys.executable, "-m", "pip", "uninstall", "--yes", dist])
    if rc:
        raise ColibriError(f"pip could not uninstall {dist} (exit status {rc})")


@app.command()
def plan(
    model: Optional[Path] = typer.Option(None, "--model", "-m", envvar="COLIBRI_MODEL", help="Converted model directory, or a hub id ORG/NAME (pulled, or planned from its config.json alone)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A config.json alone (a model not downloaded yet)."),
    quant: str = typer.Option("int4", "--quant", "-q", metavar="<f32|int8|int4|native>", help="With --config: f32, int8, int4, or native (the official release run as it is, where the plugin declares it)."),
    ram: Optional[str] = RamOpt,
    pin_gb: Optional[float] = PinOpt,
    context: int = typer.Option(0, "--context", help="Tokens of state (KV cache) to reserve in the budget. 0: "
                                "none, as run, chat and serve split it (their --ram holds the weights and the expert "
                                "cache; the state grows beside it)."),
    kv_cache: Optional[str] = KvCacheOpt,
    disk_bw: Optional[str] = typer.Option(None, "--disk-bw", help="Disk bandwidth per second (e.g. 2GB) instead of measuring it."),
    mem_bw: Optional[str] = typer.Option(None, "--mem-bw", help="Memory bandwidth per second (e.g. 20GB) instead of measuring it."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ray: Optional[str] = typer.Option(None, "--ray", envvar="COLIBRI_RAY", help="Also place the experts on this Ray "
                                      "cluster's other nodes: which experts live where, RAM per node, calls per token."),
    ray_split: str = RaySplitOpt,
    prefix_cache: Optional[str] = cli_option("prefix_cache"),
    parallel: int = typer.Option(1, "--parallel", min=1, max=256, help="Requests a server decodes together "
                                 "(serve --parallel): --context tokens of state reserved for each."),
    direct: Optional[bool] = cli_option("direct"),
):
    """Show how a model fits a RAM budget: resident bytes, experts, the budget split (with --parallel
    requests' states), the prefix cache beside it, expected bytes read per token and the floor times from this machine's measured
    disk and memory bandwidth (--ray: and the placement of the experts on a Ray cluster)."""
    from . import planning

    if model is not None and config is None:  # a hub id: the model pulled from it, else its config.json alone
        from . import hub

        model, config = hub.plan_paths(model)
    p = planning.report(model, config, quant, ram=ram, pin_gb=pin_gb, context=context, kv_cache=kv_cache or "f32",
                        disk_bw=disk_bw, mem_bw=mem_bw, ray=ray, ray_split=ray_split, prefix_cache=prefix_cache,
                        parallel=parallel, read_asked=direct)
    from .container.stripe import STRIPE_FILE

    if model is not None and (Path(model) / STRIPE_FILE).exists():  # striped: where its experts are
        from .container import Container
        from .store.stripe import summary

        with Container(model) as c:
            p["stripe"] = summary(c, c.stripe)
    print(json.dumps(p, indent=2) if as_json else planning.format_report(p) + (
        f"\nstripe: {p['stripe']}" if "stripe" in p else ""))


@app.command()
def doctor(
    model: Optional[Path] = ModelOpt,
    deep: bool = typer.Option(False, "--deep", help="Also verify every checksum (reads every expert file)."),
    ray: Optional[str] = typer.Option(None, "--ray", envvar="COLIBRI_RAY", help="Also check this Ray cluster: its "
                                      "nodes, their RAM, and that each opens the same model (--ray-model)."),
    ray_model: Optional[list[str]] = RayModelOpt,
):
    """Read-only checks, one PASS/WARN/FAIL line each: kernels and SIMD path, plugin, files and sizes,
    free disk and RAM, O_DIRECT support (--deep: every checksum; --ray: the cluster). Exit status 1 on
    any FAIL."""
    from .doctor import run_checks

    if ray is not None:  # without Ray installed: one line
        from .remote import require_ray

        require_ray()
    paths, default = ray_paths(ray_model or ())
    checks = run_checks(_model_dir(model), deep=deep, ray=ray, ray_paths=paths, ray_default_path=default)
    for c in checks:
        print(c.line())
    if any(c.status == "FAIL" for c in checks):
        raise typer.Exit(1)


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks (results are measurements, never test gates).")
app.add_typer(bench_app, name="bench")
from .bench import model as _bench_model  # noqa: E402  `colibri bench --model DIR` and `colibri bench model`

_bench_model.register(bench_app)


def _check_utf8(text: str, what: str) -> None:
    """A one-line ColibriError if `text` came from bytes that are not UTF-8 (Python keeps each such
    byte as a lone surrogate, which no tokenizer, file name or JSON takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape")[:60]
        raise ColibriError(f"{what} is not valid UTF-8: {shown!r}") from None


def _show_warning(message, category, filename, lineno, file=None, line=None):
    print(f"colibri: warning: {message}", file=sys.stderr)


@bench_app.command("kernels")
def bench_kernels(
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    threads: Optional[int] = typer.Option(None, "--threads", help="Kernel threads (default: COLIBRI_THREADS or all CPUs)."),
    simd: Optional[str] = typer.Option(None, "--simd", metavar="<portable|avx2|avx512|all>", help="Code path: portable, avx2, avx512, or all (each one this "
                                                            "CPU runs, side by side; default: the one in use)."),
):
    """Each C kernel's GB/s (GFLOP/s for matrix-matrix) beside the machine's read bandwidth, measured in one run."""

    from . import kernels
    from .bench import kernels as bench

    if threads is not None:
        kernels.set_threads(threads)
    result = bench.run(simd=simd)
    print(json.dumps(result, indent=2) if json_out else bench.format_table(result))


def main() -> None:
    warnings.showwarning = _show_warning
    try:
        for arg in sys.argv[1:]:  # a prompt that is not UTF-8 was a TypeError deep in the tokenizer
            _check_utf8(arg, "an argument")
        from . import plugins

        if sys.argv[1:2] in (["--version"], ["-V"]):  # from metadata alone: no plugin imported
            print(plugins.versions_text())
            return
        try:
            plugins.registry().call_commands(app)
        except ColibriError:  # a broken plugin: the commands that repair or report still run
            if sys.argv[1:2] not in (["install"], ["uninstall"], ["--version"], ["-V"]):
                raise
        app()
    except ColibriError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as e:  # the machine's, not colibri's: a full disk (or stdout), a device error
        if not isinstance(e, BrokenPipeError):  # else the reader went away (`colibri run ... | head`): quietly
            print(f"colibri: error: {e}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what stdout still holds: nowhere to go
        sys.exit(1)
