"""The `colibri` command line. Every command's help is its docstring; a user error is one line on
stderr and exit status 1. Heavy modules are imported inside the commands that need them."""
from __future__ import annotations

import contextlib
import json
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

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Run Mixture-of-Experts language models larger than RAM, streaming experts from disk.")


def _print_version(value: bool) -> None:
    if value:
        from . import plugins

        print(plugins.versions_text())
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", "-V", is_eager=True, callback=_print_version,
                                          help="Print colibri's version and every installed plugin's, then exit.")):
    """Run Mixture-of-Experts language models larger than RAM, streaming experts from disk."""

ModelOpt = typer.Option(None, "--model", "-m", envvar="COLIBRI_MODEL", help="Converted model directory, or a checkpoint run as it is (default: the bundled demo model).")
SeedOpt = typer.Option(None, "--seed", min=-1, callback=lambda seed: None if seed == -1 else seed,
                       help="Seed for sampling (-1: random, as without one).")
StatsOpt = typer.Option(False, "--stats", help="After the stats line, print every expert-store counter.")
GrammarOpt = typer.Option(None, "--grammar", help="A grammar file the answer follows: Lark (llguidance's dialect) or GBNF (llama.cpp's), by extension (.lark, .gbnf) or content.")
JsonSchemaOpt = typer.Option(None, "--json-schema", help="A JSON schema file: the answer is JSON valid against it.")
DraftOpt = typer.Option("auto", "--draft", help="Speculative decoding: auto (a grammar's forced tokens, and the model's MTP head while it pays), mtp, grammar, off, or a drafter a plugin registers. Never changes a greedy token.")
# `plan` and `doctor` take a few of the engine's options alone (every command that loads a model takes
# them all: `command_options`)
RamOpt, PinOpt, KvCacheOpt, RaySplitOpt, RayModelOpt = map(cli_option, ("ram", "pin_gb", "kv_cache", "ray_split",
                                                                        "ray_models"))

# The trained demo model shipped inside the colibri distribution (colibri_core/demo, found through
# importlib.resources; see README): the default without --model.
DEFAULT_MODEL = demo_model()


def _model_dir(model: Optional[Path]) -> Path:
    if model is not None:
        return model
    if (DEFAULT_MODEL / "colibri.yaml").is_file():
        return DEFAULT_MODEL
    raise ColibriError(f"no model given: pass --model DIR or set COLIBRI_MODEL (the bundled demo model is "
                       f"missing from {DEFAULT_MODEL}: reinstall colibri)")


def _open(model: Optional[Path], options: EngineOptions):
    from .engine import load

    return load(_model_dir(model), options)


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
    return (f"expert_hits {s['expert_hits']} · expert_misses {s['expert_misses']} · bytes_read "
            f"{format_bytes(s['bytes_read'])} ({s['reads']} reads) · prefetch_issued {s['prefetch_issued']} · "
            f"prefetch_used {s['prefetch_used']} · prefetch_skipped {s['prefetch_skipped']} · "
            f"prefetch_recall {100 * s['prefetch_recall']:.1f}% · "
            f"io_stall_seconds {s['io_stall_seconds']:.3f}\n"
            f"cache {s['cache_slots_per_layer']} slots/layer ({s['policy']}), {s['transient_reads']} reads past them · pinned {s['pinned_experts']} experts "
            f"({format_bytes(s['pinned_bytes'])}) · direct I/O {'on' if s['direct_io'] else 'off'} · mirror "
            f"{s['mirror'] if s['mirror_in_use'] else 'off'} · history {s['history_tokens']} tokens · activations "
            f"{s['activations']} · KV cache {s['kv_cache']}\n"
            f"per-layer hit rate {layers}\n"
            f"per-layer I/O stall (ms) {stalls}\n"
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
    """Tokens, decode speed, time to first token, time, expert hits and bytes read: of the engine's life,
    or since `before` (an earlier `engine.stats()`: one chat turn); then the peak RSS."""
    from .sizes import format_bytes

    s = engine.stats()
    d = {k: s[k] - (before or {}).get(k, 0) for k in ("generated_tokens", "decode_seconds", "expert_hits",
                                                      "expert_misses", "bytes_read")}
    tps = max(0, d["generated_tokens"] - 1) / d["decode_seconds"] if d["decode_seconds"] else 0.0
    lookups = d["expert_hits"] + d["expert_misses"]
    return (f"[{d['generated_tokens']} tokens · {tps:.1f} tok/s · "
            f"TTFT {s['time_to_first_token']:.2f} s · {seconds:.2f} s total · "
            f"expert hit rate {100 * d['expert_hits'] / max(1, lookups):.1f}% ({d['expert_hits']} hits, "
            f"{d['expert_misses']} misses) · read {format_bytes(d['bytes_read'])} · "
            f"peak RSS {format_bytes(s['peak_rss_bytes'])}]")


def _room(engine, n_tokens: int, max_tokens: int) -> int:
    """`max_tokens`, cut to what the model's context leaves after `n_tokens` (the server refuses what
    does not fit; here the answer just ends there); a ColibriError when the prompt leaves no room."""
    ctx = engine.context_length
    if ctx is None:
        return max_tokens
    if n_tokens >= ctx:
        raise ColibriError(f"the prompt is {n_tokens} tokens; this model's context is {ctx}")
    return min(max_tokens, ctx - n_tokens)


@app.command()
@command_options
def run(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most new tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = no top-k cut."),
    seed: Optional[int] = SeedOpt,
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template as a user turn."),
    stats: bool = StatsOpt,
    draft: str = DraftOpt,
    grammar: Optional[Path] = GrammarOpt,
    json_schema: Optional[Path] = JsonSchemaOpt,
    *, options: EngineOptions,  # every engine option (colibri_core/options.py): command_options
):
    """Generate a completion of PROMPT, print it, then one stats line (--stats: every store counter)."""
    from .chat_template import ChatTemplate
    from .tokenizer import StreamDecoder

    t0 = time.perf_counter()
    engine = _open(model, options)
    text = prompt
    if chat:
        template = ChatTemplate.from_dir(engine.model_dir)
        if template is None:
            raise ColibriError(f"{engine.model_dir}: --chat needs a chat template, and this model has none")
        text = template.render([{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(text, add_special_tokens=not chat)
    make = _structure(engine, grammar, json_schema)
    decoder = StreamDecoder(engine.tokenizer)
    for token in engine.stream(ids, _room(engine, len(ids), max_tokens), temperature, top_p, top_k, seed,
                               draft=draft, constraint=make and make()):
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats_line(engine, time.perf_counter() - t0), file=sys.stderr)
    if stats:
        print(store_report(engine), file=sys.stderr)
        if engine.experts.remote is not None:
            print(remote_report(engine), file=sys.stderr)
    engine.close()


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
    draft: str = DraftOpt,
    grammar: Optional[Path] = GrammarOpt,
    json_schema: Optional[Path] = JsonSchemaOpt,
    session_name: Optional[str] = typer.Option(None, "--session", help="Save the conversation as NAME beside "
                                               "the model after every turn and resume it when started again."),
    *, options: EngineOptions,  # every engine option (colibri_core/options.py): command_options
):
    """Chat interactively, streaming tokens. Commands: /reset, /stats, /exit."""
    from .chat_template import ChatTemplate
    from .kv.session import SessionWarning
    from .tokenizer import StreamDecoder

    engine = _open(model, options)
    with engine:  # closed at the end: its session locks released, its I/O threads stopped
        template = ChatTemplate.from_dir(engine.model_dir)
        make = _structure(engine, grammar, json_schema)  # each answer follows it
        if template is not None:  # special tokens typed in a message stay text, as the server keeps them
            from .server.text import ChatText

            chat_text = ChatText(engine.tokenizer)
        session, messages = engine.new_session(), []
        if session_name is not None:
            _check_saveable(engine, session_name)  # before the first answer, not after it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SessionWarning)  # printed below as one line
                session = engine.open_session(session_name)
            if session.notice:
                print(f"colibri: note: {session.notice}", file=sys.stderr)
            messages = _saved_messages(session, session_name)
            if messages:
                print(f"(resumed session {session_name}: {len(messages)} messages, {len(session.ids)} tokens)",
                      file=sys.stderr)
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
            if template is not None:
                ids = chat_text.encode(template.render(chat_text.mask(messages)))
            else:  # a base model: the conversation is plain text
                ids = engine.tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")
            try:
                room = _room(engine, len(ids), max_tokens)
            except ColibriError as e:  # the conversation outgrew the context: this question is not asked
                messages.pop()
                print(f"colibri: error: {e}; /reset starts over", file=sys.stderr)
                continue
            decoder, answer = StreamDecoder(engine.tokenizer), []
            t0, before = time.perf_counter(), engine.stats()
            # one turn, one record: the state the answer leaves and the messages with the answer together
            turn = session.turn() if session_name is not None else contextlib.nullcontext()
            try:
                with turn:
                    tokens = engine.stream(ids, room, temperature, top_p, top_k, seed, session=session,
                                           draft=draft, constraint=make and make())
                    try:
                        for token in tokens:
                            answer.append(token)
                            sys.stdout.write(decoder.push(token))
                            sys.stdout.flush()
                    finally:
                        tokens.close()  # an answer cut short ends here, inside the turn (which then saves nothing)
                    messages.append({"role": "assistant", "content": engine.tokenizer.decode(answer)})
            except KeyboardInterrupt:  # Ctrl-C stops the answer, not the chat: the turn never happened
                messages.pop()
                print("\n(interrupted: the question and its partial answer are forgotten)", file=sys.stderr)
                continue
            print()
            print(stats_line(engine, time.perf_counter() - t0, before), file=sys.stderr)


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
QueueOpt = typer.Option(16, "--queue", min=0, help="Requests that may wait behind the running one; more get 429.")
NameOpt = typer.Option(None, "--model-name", help="Model id clients send (default: the model directory's name).")
OriginOpt = typer.Option(None, "--allow-origin", help="A web origin (scheme://host, :port if not the default) whose pages may call the "
                         "API (CORS), and whose host name the server answers to; repeat for several; '*' for any. "
                         "By default only the server's own pages and non-browser clients are served.")
MaxTokensOpt = typer.Option(None, "--max-tokens", min=1, help="Most tokens one request may generate "
                            "(default: the model's context).")


def _serve(dashboard: bool, model, host, port, api_key, queue, model_name, allow_origin, max_tokens,
           options: EngineOptions):
    import os

    from .server import ServerConfig, serve

    if api_key is None and "COLIBRI_API_KEY" in os.environ:  # set but empty: click treats it as unset
        api_key = os.environ["COLIBRI_API_KEY"]
    serve(ServerConfig(_model_dir(model), model_name=model_name, max_queue=queue, api_key=api_key,
                       dashboard=dashboard, allow_origins=tuple(allow_origin or ()), max_tokens=max_tokens,
                       engine=options),
          host=host, port=port)


@app.command()
@command_options
def serve(model: Optional[Path] = ModelOpt, host: str = HostOpt, port: int = PortOpt, api_key: Optional[str] = ApiKeyOpt,
          queue: int = QueueOpt, model_name: Optional[str] = NameOpt, allow_origin: Optional[list[str]] = OriginOpt,
          max_tokens: Optional[int] = MaxTokensOpt, *, options: EngineOptions):
    """Serve the model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
    /v1/models, /health, /tokenize, /detokenize, /metrics (Prometheus), /openapi.json."""
    _serve(False, model, host, port, api_key, queue, model_name, allow_origin, max_tokens, options)


@app.command()
@command_options
def web(model: Optional[Path] = ModelOpt, host: str = HostOpt, port: int = PortOpt, api_key: Optional[str] = ApiKeyOpt,
        queue: int = QueueOpt, model_name: Optional[str] = NameOpt, allow_origin: Optional[list[str]] = OriginOpt,
        max_tokens: Optional[int] = MaxTokensOpt, *, options: EngineOptions):
    """Serve the API and a live dashboard at / : chat, tok/s, time to first token, where the time
    goes, the RAM budget, hit rate over time, the Brain map of every expert (and, with --ray, the
    cluster's shards)."""
    _serve(True, model, host, port, api_key, queue, model_name, allow_origin, max_tokens, options)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Hugging Face checkpoint directory (config.json + safetensors)."),
    dst: Path = typer.Argument(..., help="Container directory to create."),
    quant: str = typer.Option("int4", "--quant", "-q", help="f32, int8 or int4 for weight matrices (routers and norms stay f32)."),
):
    """Convert a Hugging Face checkpoint into a colibri container (resumable, published atomically)."""
    from .convert import convert_checkpoint

    arch = convert_checkpoint(src, dst, quant)
    print(f"converted {src} → {dst} ({arch.name}, {quant})", file=sys.stderr)


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
    model: Optional[Path] = typer.Option(None, "--model", "-m", envvar="COLIBRI_MODEL", help="Converted model directory."),
    config: Optional[Path] = typer.Option(None, "--config", help="A config.json alone (a model not downloaded yet)."),
    quant: str = typer.Option("int4", "--quant", "-q", help="With --config: f32, int8, int4, or native (the official release run as it is, where the plugin declares it)."),
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
):
    """Show how a model fits a RAM budget: resident bytes, experts, the budget split, the prefix
    cache beside it, expected bytes read per token and the floor times from this machine's measured
    disk and memory bandwidth (--ray: and the placement of the experts on a Ray cluster)."""
    from . import planning

    p = planning.report(model, config, quant, ram=ram, pin_gb=pin_gb, context=context, kv_cache=kv_cache or "f32",
                        disk_bw=disk_bw, mem_bw=mem_bw, ray=ray, ray_split=ray_split, prefix_cache=prefix_cache)
    print(json.dumps(p, indent=2) if as_json else planning.format_report(p))


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


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results are measurements, never test gates).")
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
    simd: Optional[str] = typer.Option(None, "--simd", help="Code path: portable, avx2, avx512, or all (each one this "
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
