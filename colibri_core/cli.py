"""The `colibri` command line. Every command's help is its docstring; a user error is one line on
stderr and exit status 1. Heavy modules are imported inside the commands that need them."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .errors import ColibriError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Run Mixture-of-Experts language models larger than RAM, streaming experts from disk.")

ModelOpt = typer.Option(None, "--model", "-m", envvar="COLIBRI_MODEL", help="Converted model directory [env: COLIBRI_MODEL].")
RamOpt = typer.Option(None, "--ram", help="RAM budget for weights and expert cache, e.g. 4GB (default: 80% of available).")
SlotsOpt = typer.Option(None, "--cache-slots", help="Expert cache slots per layer (overrides --ram).")


def _model_dir(model: Optional[Path]) -> Path:
    if model is None:
        raise ColibriError("no model given: pass --model DIR or set COLIBRI_MODEL")
    return model


def _open(model, ram, cache_slots):
    from .engine import load

    return load(_model_dir(model), ram=ram, cache_slots=cache_slots)


def stats_line(engine, seconds: float) -> str:
    from .engine import format_bytes

    s = engine.stats()
    return (f"[{s['generated_tokens']} tokens · {s['decode_tokens_per_second']:.1f} tok/s · "
            f"TTFT {s['time_to_first_token']:.2f} s · {seconds:.2f} s total · "
            f"expert hit rate {100 * s['hit_rate']:.1f}% ({s['expert_hits']} hits, {s['expert_misses']} misses) · "
            f"read {format_bytes(s['bytes_read'])} · peak RSS {format_bytes(s['peak_rss_bytes'])}]")


@app.command()
def run(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most new tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = no top-k cut."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    ram: Optional[str] = RamOpt,
    cache_slots: Optional[int] = SlotsOpt,
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template as a user turn."),
):
    """Generate a completion of PROMPT, print it, then one stats line."""
    from .chat_template import ChatTemplate
    from .tokenizer import StreamDecoder

    t0 = time.perf_counter()
    engine = _open(model, ram, cache_slots)
    text = prompt
    if chat:
        template = ChatTemplate.from_dir(engine.model_dir)
        if template is None:
            raise ColibriError(f"{engine.model_dir}: --chat needs a chat template, and this model has none")
        text = template.render([{"role": "user", "content": prompt}])
    ids = engine.tokenizer.encode(text, add_special_tokens=not chat)
    decoder = StreamDecoder(engine.tokenizer)
    for token in engine.stream(ids, max_tokens, temperature, top_p, top_k, seed):
        sys.stdout.write(decoder.push(token))
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stats_line(engine, time.perf_counter() - t0), file=sys.stderr)


@app.command()
def chat(
    model: Optional[Path] = ModelOpt,
    max_tokens: int = typer.Option(512, "--max-tokens", help="Most new tokens per answer."),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.95, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None),
    ram: Optional[str] = RamOpt,
    cache_slots: Optional[int] = SlotsOpt,
    session_name: Optional[str] = typer.Option(None, "--session", help="Save the conversation as NAME beside "
                                               "the model after every turn and resume it when started again."),
):
    """Chat interactively, streaming tokens. Commands: /reset, /stats, /exit."""
    import warnings

    from .chat_template import ChatTemplate
    from .kv.session import SessionWarning
    from .tokenizer import StreamDecoder

    engine = _open(model, ram, cache_slots)
    template = ChatTemplate.from_dir(engine.model_dir)
    session, messages = engine.new_session(), []
    if session_name is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SessionWarning)  # printed below as one line
            session = engine.open_session(session_name)
        if session.notice:
            print(f"colibri: note: {session.notice}", file=sys.stderr)
        messages = session.meta.setdefault("messages", [])
        if session.turns:
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
            print(json.dumps(engine.stats(), indent=2, default=str), file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        if template is not None:
            ids = engine.tokenizer.encode(template.render(messages), add_special_tokens=False)
        else:  # a base model: the conversation is plain text
            ids = engine.tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")
        decoder, answer = StreamDecoder(engine.tokenizer), []
        t0 = time.perf_counter()
        for token in engine.stream(ids, max_tokens, temperature, top_p, top_k, seed, session=session):
            answer.append(token)
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()
        print()
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(answer)})
        if session_name is not None:
            session.save()  # the turn's state was saved when the answer ended; now its messages too
        print(stats_line(engine, time.perf_counter() - t0), file=sys.stderr)


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
    """List installed plugins: name, version, architectures, hooks (imports no model code)."""
    from . import plugins

    registry = plugins.registry()
    rows = [{"name": p.distribution, "version": p.version, "architectures": p.architectures, "hooks": p.hooks}
            for p in registry.plugins.values()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print("no plugins installed (colibri install colibri-olmoe)")
    for r in rows:
        print(f"{r['name']} {r['version']}: architectures {', '.join(r['architectures']) or '-'}; hooks {', '.join(r['hooks'])}")
    for name in registry.skipped:
        print(f"{name}: not loaded (COLIBRI_LOAD_PLUGINS)")


@app.command()
def install(target: str = typer.Argument(..., help="A plugin directory, a wheel, or a package name.")):
    """Install a plugin with pip into colibri's own environment."""
    if Path(target).exists():
        target = str(Path(target).resolve())
    elif "/" in target or target.startswith("."):
        raise ColibriError(f"{target}: no such plugin directory or wheel")
    rc = subprocess.call([sys.executable, "-m", "pip", "install", target])
    if rc:
        raise ColibriError(f"pip could not install {target} (exit status {rc})")


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results are measurements, never test gates).")
app.add_typer(bench_app, name="bench")


def main() -> None:
    try:
        from . import plugins

        plugins.registry().call_commands(app)
        app()
    except ColibriError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
