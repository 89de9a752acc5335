"""Models by hub id: `colibri pull ORG/NAME[@REVISION][:QUANT]`, `colibri list`, `colibri rm`, and
`--model ORG/NAME` wherever a command takes a model.

Everything goes through `huggingface_hub`: its cache (HF_HOME / HF_HUB_CACHE), token (HF_TOKEN),
endpoint (HF_ENDPOINT), revisions, resumed downloads and progress bars. `pull` resolves the revision
to its commit hash first and pins every download to it; it fetches config.json and the tokenizer,
states the peak disk it needs (the container, the largest shard, a margin) and refuses in one line
if the disk cannot hold it; then it downloads the safetensors shards one after another, converting
each as it lands and deleting it from the hub cache once all its tensors are written
(`container.streamed`; `--keep-source` keeps them). A pull killed at any point resumes where it
stopped: the conversion from its progress log, which the commit hash binds; the downloads file by
file (a file finished is in the cache; huggingface_hub 1.x resumes one cut short, 2.x starts it
again, and the temporaries a kill leaves behind, the download's and its file-mode probe, are
deleted by the next pull, `_sweep`). A pull that finds its container whole deletes the source
files a kill left in the cache (unless `--keep-source`).

A GGUF repository (llama.cpp's `-hf ORG/NAME:QUANT` convention: `:Q4_K_M` picks the file by the
quantisation its name ends with, case-insensitively; the suffix may be left out where the repository
holds one) is pulled whole, its file or all the parts of a split one, then converted by `gguf_in`
and deleted unless `--keep-source`: its peak disk is the GGUF plus the container.

Pulled models live in one place, ``$COLIBRI_HOME/models`` (default ``$XDG_DATA_HOME/colibri/models``,
i.e. ``~/.local/share/colibri/models``), one directory per hub id, ``ORG--NAME`` (a container; with
``--quant native``, the checkpoint itself, run as it is).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import yaml

from .container.reader import COPIED_FILES, MANIFEST, hold
from .errors import ColibriError

__all__ = ["models_dir", "parse_id", "model_path", "resolve", "plan_paths", "hub_config", "pull", "list_models", "remove"]

HUB_ID = re.compile(r"([A-Za-z0-9][\w.-]*)/([A-Za-z0-9][\w.-]*)(?:@([\w./-]+))?(?::([\w.-]+))?")
# the quantisation a GGUF file's name ends with (Qwen3-30B-A3B-Q4_K_M.gguf, gpt-oss-20b-MXFP4.gguf, …-UD-Q4_K_XL-…)
GGUF_QUANT = re.compile(r"[-._]((?:UD-)?(?:I?Q\d[A-Z0-9_]*|T?Q\d_\d|BF16|F16|F32|MXFP4[A-Z0-9_]*))$", re.I)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PULL_RECORD = "colibri-pull.json"  # in a checkpoint pulled with --quant native: what it was pulled from
# a conversion's working directories beside the model: the unfinished container, a GGUF's dequantised
# blocks (gguf_in.WORK_SUFFIX, spelled out here so that `colibri list` and `rm` load no converter)
GGUF_WORK = ".gguf-work"
WORK_SUFFIXES = (".partial", GGUF_WORK)
MARGIN = 64 << 20  # beside the stash: the small files and the file system's own blocks
# huggingface_hub >= 2 downloads a file into a temporary of its own, BLOB.<8 hex digits>.incomplete
# (1.x: BLOB.incomplete, which it resumes), under the lock .locks/models--ORG--NAME/BLOB.lock; before
# renaming it to BLOB it reads the cache's file mode off an empty tmp_<uuid4> it creates beside it
UNFINISHED = re.compile(r"([^.]+)\.[0-9a-f]{8}\.incomplete")
MODE_PROBE = re.compile(r"tmp_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# once a process, it asks whether the cache takes symlinks in a folder tmpXXXXXXXX of the cache's root
# holding these two files, removed microseconds later; one older than SYMLINK_PROBE_AGE a kill left
SYMLINK_PROBE, SYMLINK_PROBE_FILES, SYMLINK_PROBE_AGE = re.compile(r"tmp\w{8}"), {"dummy_file_src", "dummy_file_dst"}, 60


def models_dir() -> Path:
    """Where pulled models live: $COLIBRI_HOME/models, else $XDG_DATA_HOME/colibri/models."""
    home = os.environ.get("COLIBRI_HOME")
    if home:
        return Path(home).expanduser() / "models"
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "colibri" / "models"


def parse_id(spec: str) -> tuple[str, str | None, str | None] | None:
    """("ORG/NAME", revision or None, GGUF quantisation or None) of a hub id
    "ORG/NAME[@REVISION][:QUANT]"; None if `spec` is not one."""
    m = HUB_ID.fullmatch(str(spec))
    return (f"{m[1]}/{m[2]}", m[3], m[4]) if m else None


def model_path(repo: str) -> Path:
    """The directory a pull of `repo` ("ORG/NAME") writes."""
    return models_dir() / repo.replace("/", "--")


def _pulled(path: Path) -> dict | None:
    """What `path` was pulled from ({"repo", "revision", "quant"}), None if it is no pulled model."""
    try:
        if (path / MANIFEST).is_file():
            with open(path / MANIFEST, "rb") as f:
                manifest = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            return {**manifest["source"]["origin"], "quant": manifest["quant"], "architecture": manifest["architecture"],
                    "plugin": manifest["plugin"]["name"]}
        if (path / PULL_RECORD).is_file():
            return json.loads((path / PULL_RECORD).read_text())
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return None
    return None


def resolve(model: str | os.PathLike | None) -> Path | None:
    """`--model` as a directory: an existing path as it is; a hub id "ORG/NAME[@REVISION]" as the
    model pulled from it (a one-line error if it was not pulled, or at another revision)."""
    if model is None or Path(model).exists():
        return None if model is None else Path(model)
    parsed = parse_id(str(model))
    if parsed is None:
        return Path(model)
    repo, revision, gguf_quant = parsed
    path = model_path(repo)
    record = _pulled(path)
    if record is None:
        raise ColibriError(f"{model} is neither a directory nor a pulled model: run `colibri pull {model}`")
    if revision is not None and revision not in (record["revision"], record.get("asked")):
        raise ColibriError(f"{repo} is pulled at revision {record['revision'][:12]}, not {revision}: run "
                           f"`colibri pull {model}`")
    if gguf_quant is not None and gguf_quant.upper() != record.get("gguf_quant"):
        raise ColibriError(f"{repo} is pulled from {record.get('gguf_quant') or 'its safetensors'}, not {gguf_quant}: "
                           f"run `colibri pull {model}`")
    return path


def plan_paths(model: str | os.PathLike) -> tuple[Path | None, Path | None]:
    """`plan --model`'s (model directory, config.json): a hub id not pulled yet is planned from
    its config.json alone, downloaded by itself."""
    parsed = None if Path(model).exists() else parse_id(str(model))
    if parsed is None or _pulled(model_path(parsed[0])) is not None:
        return resolve(model), None
    return None, hub_config(str(model))


def _hub():
    """huggingface_hub, imported when a command first needs it."""
    try:
        import huggingface_hub
        import huggingface_hub.errors  # noqa: F401  (`_download` names its exceptions)
    except ImportError:
        raise ColibriError("pulling from a model hub needs huggingface_hub: pip install huggingface_hub") from None
    return huggingface_hub


def _commit(hf, repo: str, revision: str | None):
    """The model's info at `revision` (default main), its files' sizes included: one line on failure."""
    from huggingface_hub import errors

    try:
        return hf.HfApi().model_info(repo, revision=revision, files_metadata=True)
    except errors.RepositoryNotFoundError:
        raise ColibriError(f"{repo}: no such model on {hf.constants.ENDPOINT} (or it is private: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ColibriError(f"{repo} has no revision {revision!r}") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        raise ColibriError(f"cannot reach {hf.constants.ENDPOINT} for {repo}: {' '.join(str(e).split())[:200]}") from None


def _download(hf, repo: str, name: str, commit: str) -> Path:
    try:
        return Path(hf.hf_hub_download(repo, name, revision=commit))
    except (hf.errors.HfHubHTTPError, OSError, ValueError) as e:
        raise ColibriError(f"downloading {name} of {repo}@{commit[:12]} failed: {' '.join(str(e).split())[:200]}; "
                           "rerun the same command to resume") from None


def _cached(hf, repo: str) -> Path:
    """The hub cache's folder of `repo` (blobs/, snapshots/COMMIT/NAME symlinks to them)."""
    return Path(hf.constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"


def _sweep(hf, repo: str) -> None:
    """Delete the unfinished downloads of `repo` a killed pull left in the hub cache: a temporary
    no process downloads into any more (nobody holds its blob's lock), which huggingface_hub >= 2
    never reuses; a download running in another process keeps its own. Then, where no download
    is running, the mode probes (tmp_<uuid4>) a kill between a probe's creation and its deletion
    left: a probe lives only while its download's temporary does, under that temporary's lock. And
    the symlink probe's folder a kill left in the cache's root (SYMLINK_PROBE)."""
    from filelock import FileLock, Timeout

    blobs = _cached(hf, repo) / "blobs"
    running = False
    for tmp in sorted(blobs.glob("*.incomplete")) if blobs.is_dir() else ():
        m = UNFINISHED.fullmatch(tmp.name)
        if m is None:
            continue
        lock = FileLock(Path(hf.constants.HF_HUB_CACHE) / ".locks" / _cached(hf, repo).name / f"{m[1]}.lock")
        try:
            with lock.acquire(timeout=0):
                tmp.unlink(missing_ok=True)
        except Timeout:
            running = True
    for probe in () if running else blobs.glob("tmp_*"):
        if MODE_PROBE.fullmatch(probe.name):
            probe.unlink(missing_ok=True)
    root = Path(hf.constants.HF_HUB_CACHE)
    for probe in root.glob("tmp*") if root.is_dir() else ():
        try:
            if (SYMLINK_PROBE.fullmatch(probe.name) and probe.is_dir() and time.time() - probe.stat().st_mtime >
                    SYMLINK_PROBE_AGE and {f.name for f in probe.iterdir()} <= SYMLINK_PROBE_FILES):
                shutil.rmtree(probe)
        except OSError:  # another pull swept it first
            pass


def _drop_source(hf, repo: str, commit: str, names) -> None:
    """Delete the files `names` of `repo`@`commit` from the hub cache, where they are: the blob
    first, then its snapshot link, so that a kill between the two leaves the link, which the
    next pull finds, never a blob nothing names."""
    for name in names:
        link = _cached(hf, repo) / "snapshots" / commit / name
        if os.path.lexists(link):
            Path(os.path.realpath(link)).unlink(missing_ok=True)
            link.unlink(missing_ok=True)


def hub_config(spec: str) -> Path:
    """config.json of the hub model `spec` (downloaded alone): what `plan --model ORG/NAME` reads."""
    hf = _hub()
    repo, revision, _ = parse_id(spec)
    info = _commit(hf, repo, revision)
    if "config.json" not in {s.rfilename for s in info.siblings or ()}:
        raise ColibriError(f"{repo} has no config.json (a GGUF repository is planned once pulled: colibri pull {spec})")
    return _download(hf, repo, "config.json", info.sha)


def _free(path: Path) -> tuple[int, int]:
    """(device, free bytes) of the file system `path` is (or will be) on."""
    while not path.exists():
        path = path.parent
    return path.stat().st_dev, shutil.disk_usage(path).free


def _shards(hf, repo: str, commit: str, files: dict[str, int]) -> list[str]:
    if INDEX in files:
        index = json.loads(_download(hf, repo, INDEX, commit).read_text())
        return sorted(set(index["weight_map"].values()))
    if SINGLE in files:
        return [SINGLE]
    raise ColibriError(f"{repo} holds no safetensors checkpoint ({INDEX} or {SINGLE}); colibri pulls those")


def pull(spec: str, quant: str = "int4", keep_source: bool = False, progress: bool = True) -> tuple[Path, dict]:
    """Pull the hub model `spec` ("ORG/NAME[@REVISION][:QUANT]", QUANT a GGUF repository's file)
    into `model_path`, converted at `quant` (int4, int8, f32; "native": the checkpoint kept as it is).
    Returns its directory and the figures of the pull: {"container_bytes", "largest_shard" (a GGUF
    pull: the GGUF), "margin", "peak_bytes"} (a GGUF pull adds "gguf": its files)."""
    from . import plugins, quant as q
    from .container.streamed import RemoteCheckpoint, convert_streamed
    from .convert import generation_defaults, parse_config, read_config
    from .planning import NATIVE, sizes_from_config
    from .sizes import format_bytes

    parsed = parse_id(spec)
    if parsed is None:
        raise ColibriError(f"{spec!r} is not a hub id: ORG/NAME, ORG/NAME@REVISION or ORG/NAME:QUANT (a GGUF's)")
    if quant not in (*q.KINDS, NATIVE):
        raise ColibriError(f"unknown quantisation {quant!r}: choose one of {', '.join((*q.KINDS, NATIVE))}")
    hf = _hub()
    repo, revision, gguf_quant = parsed
    info = _commit(hf, repo, revision)
    commit, files = info.sha, {s.rfilename: s.size or 0 for s in info.siblings or ()}
    gguf = None
    if gguf_quant is not None or not (INDEX in files or SINGLE in files) and any(n.endswith(".gguf") for n in files):
        gguf = gguf_choice(repo, files, gguf_quant)
        if quant == NATIVE:
            raise ColibriError(f"{repo} is pulled from a GGUF, which colibri converts: --quant int4, int8 or f32")
    dst = model_path(repo)
    _sweep(hf, repo)
    record = _pulled(dst)
    if record and record["revision"] == commit and record["quant"] == quant and \
            record.get("gguf_quant") == (gguf and gguf[0]):
        if not keep_source and quant != NATIVE:  # a kill between the container's rename and the source's deletion
            _drop_source(hf, repo, commit, gguf[1] if gguf else [n for n in files if n.endswith(".safetensors")])
        # and one between the rename and the removal of a GGUF conversion's work folder
        shutil.rmtree(dst.with_name(dst.name + GGUF_WORK), ignore_errors=True)
        print(f"{repo} is pulled already at {commit[:12]} ({quant}): {dst}", file=sys.stderr)
        return dst, {}
    say = (lambda m: print(m, file=sys.stderr)) if progress else (lambda m: None)
    say(f"pulling {repo} at {commit[:12]} ({f'{gguf[0]} GGUF → ' if gguf else ''}{quant}) into {dst}")
    if gguf is not None:
        return _pull_gguf(hf, repo, commit, revision, files, gguf, quant, keep_source, dst, progress)
    small = [_download(hf, repo, name, commit) for name in COPIED_FILES if name in files]
    if "config.json" not in files:
        raise ColibriError(f"{repo}@{commit[:12]} has no config.json: not a Hugging Face model repository")
    snapshot = small[0].parent
    shards = _shards(hf, repo, commit, files)
    if quant == NATIVE:
        return _pull_native(hf, repo, commit, revision, shards, files, dst, progress)

    config = read_config(snapshot)
    registry = plugins.registry()
    arch = registry.resolve(config, where=f"{repo}/config.json")
    model_cls = registry.model_class(arch)
    layout = model_cls.layout(parse_config(model_cls, config, snapshot / "config.json"))
    generation_defaults(snapshot)  # its token ids, checked before anything large is downloaded
    sizes, _ = sizes_from_config(snapshot / "config.json", quant)
    api = hf.HfApi()
    headers = {}
    for shard in shards:
        meta = api.parse_safetensors_file_metadata(repo, shard, revision=commit)
        headers[shard] = {n: (t.dtype, tuple(t.shape)) for n, t in meta.tensors.items()}
    figures = _disk_plan(sizes, headers, {s: files.get(s, 0) for s in shards}, dst, Path(hf.constants.HF_HUB_CACHE))
    say(f"disk: the container {format_bytes(figures['container_bytes'])} + the largest shard "
        f"{format_bytes(figures['largest_shard'])} + {format_bytes(figures['margin'])} margin at most")

    def fetch(shard: str) -> Path:
        return _download(hf, repo, shard, commit)

    def release(shard: str) -> None:
        if not keep_source:
            _drop_source(hf, repo, commit, [shard])

    remote = RemoteCheckpoint(snapshot, {s: files.get(s, 0) for s in shards}, headers, fetch, release,
                              {"repo": repo, "revision": commit})
    force = (dst / MANIFEST).is_file()  # another revision or quantisation: replaced once this one is whole
    if dst.exists() and not force:
        raise ColibriError(f"{dst} exists and is not a pulled model: remove it (colibri rm {repo})")
    peak = convert_streamed(remote, dst, quant=quant, layout=layout, architecture=arch.name, plugin=arch.plugin,
                            plugin_version=arch.version, progress=progress, force=force,
                            watch=(_cached(hf, repo), dst.with_name(dst.name + ".partial"), dst))
    if not keep_source:  # a shard a resumed pull found written already is never fetched nor released
        _drop_source(hf, repo, commit, shards)
    figures["peak_bytes"] = peak
    return dst, figures


def gguf_choice(repo: str, files: dict[str, int], quant: str | None) -> tuple[str, list[str]]:
    """(quantisation, its GGUF file or the parts of its split GGUF in order) among the repository's
    `files`, chosen by `quant` (case-insensitive; None: the only one there is); one line naming
    the quantisations there are when `quant` is absent or ambiguous."""
    from .gguf_in import SPLIT

    by_quant: dict[str, dict[str, list[str]]] = {}  # quantisation -> the file's stem -> its files
    for name in files:
        base = name.rsplit("/", 1)[-1]
        if not base.endswith(".gguf") or base.startswith("mmproj"):  # a vision projector, not the model
            continue
        stem = SPLIT.sub("", base).removesuffix(".gguf")
        m = GGUF_QUANT.search(stem)
        by_quant.setdefault((m[1] if m else stem).upper(), {}).setdefault(name[:len(name) - len(base)] + stem, []).append(name)
    have = ", ".join(sorted(by_quant)) or "none"
    if quant is None:
        if len(by_quant) != 1:
            raise ColibriError(f"{repo} holds GGUF files of several quantisations: name one, {repo}:QUANT ({have})")
        quant = next(iter(by_quant))
    stems = by_quant.get(quant.upper())
    if stems is None:
        raise ColibriError(f"{repo} has no {quant} GGUF file; its quantisations: {have}")
    if len(stems) > 1:
        raise ColibriError(f"{repo} has {len(stems)} {quant.upper()} GGUF models ({', '.join(sorted(stems))}): "
                           "colibri pulls a repository holding one")
    parts = sorted(next(iter(stems.values())))  # one file, or the parts of a split one
    split = SPLIT.search(parts[0])
    if split and len(parts) != int(split[2]):
        raise ColibriError(f"{repo}'s {quant.upper()} GGUF is split in {int(split[2])} parts and the repository "
                           f"holds {len(parts)} of them")
    return quant.upper(), parts


def _pull_gguf(hf, repo: str, commit: str, asked: str | None, files: dict[str, int], gguf: tuple[str, list[str]],
               quant: str, keep_source: bool, dst: Path, progress: bool) -> tuple[Path, dict]:
    """The GGUF file (every part of a split one) downloaded whole, converted by gguf_in into `dst`,
    then deleted from the hub cache unless `keep_source`: peak disk, the GGUF and the container."""
    from .container.streamed import disk_bytes
    from .gguf_in import convert_gguf, hf_config, read
    from .planning import sizes_from_config
    from .sizes import format_bytes

    label, names = gguf
    source = sum(files[n] for n in names)
    _, free = _free(Path(hf.constants.HF_HUB_CACHE))
    if source > free:
        raise ColibriError(f"the pull needs {format_bytes(source)} free on {hf.constants.HF_HUB_CACHE} for "
                           f"{repo}'s {label} GGUF; it has {format_bytes(free)}")
    parts = [_download(hf, repo, n, commit) for n in names]
    sizes, _ = sizes_from_config(f"{parts[0]} (its metadata)", quant, config=hf_config(read(parts)))
    container = sizes.dense_bytes + sizes.experts_total * sizes.expert_nbytes
    done = disk_bytes(dst.with_name(dst.name + ".partial"))
    _, free = _free(dst.parent)
    if container + MARGIN - done > free:
        raise ColibriError(f"the pull needs {format_bytes(container + MARGIN - done)} free on {dst.parent} for the "
                           f"container of {repo}; it has {format_bytes(free)}")
    force = (dst / MANIFEST).is_file()
    if dst.exists() and not force:
        raise ColibriError(f"{dst} exists and is not a pulled model: remove it (colibri rm {repo})")
    _, errors = convert_gguf(parts, dst, quant, progress=progress, force=force,
                             origin={"repo": repo, "revision": commit, "asked": asked, "gguf_quant": label})
    for kind, e in errors.items():
        if progress:
            print(f"requantised {e['tensors']} {kind} tensors to {quant}: relative RMS error mean "
                  f"{e['mean_rel_rms']:.2e}, max {e['max_rel_rms']:.2e}", file=sys.stderr)
    peak = disk_bytes(*{Path(os.path.realpath(p)) for p in parts}, dst)
    if not keep_source:
        _drop_source(hf, repo, commit, names)
    return dst, {"container_bytes": container, "largest_shard": source, "margin": MARGIN, "peak_bytes": peak,
                 "gguf": names}


def _disk_plan(sizes, headers: dict, shard_sizes: dict[str, int], dst: Path, cache: Path) -> dict:
    """The peak disk a pull needs, refused in one line where the free space cannot hold it: the
    container, the largest shard and a margin (stashes of tensors that straddle two shards: at most
    two of the largest tensor; the small files)."""
    from .container.reader import _ST_DTYPES  # bytes per element of each safetensors dtype
    from .container.streamed import disk_bytes
    from .sizes import format_bytes

    def nbytes(dtype: str, shape) -> int:
        n = 1
        for d in shape:
            n *= d
        return n * (_ST_DTYPES[dtype].itemsize if dtype in _ST_DTYPES else 1)

    largest_tensor = max((nbytes(d, s) for h in headers.values() for d, s in h.values()), default=0)
    container = sizes.dense_bytes + sizes.experts_total * sizes.expert_nbytes
    figures = {"container_bytes": container, "largest_shard": max(shard_sizes.values(), default=0),
               "margin": 2 * largest_tensor + MARGIN}
    done = disk_bytes(dst.with_name(dst.name + ".partial"))  # a resumed pull's finished part
    need = {}
    for where, n in ((dst.parent, container + figures["margin"] - done), (cache, figures["largest_shard"])):
        dev, free = _free(where)
        need.setdefault(dev, [0, free, where])[0] += n
    for n, free, where in need.values():
        if n > free:
            raise ColibriError(f"the pull needs {format_bytes(n)} free on {where} (container "
                               f"{format_bytes(container)} + largest shard {format_bytes(figures['largest_shard'])} + "
                               f"margin {format_bytes(figures['margin'])}); it has {format_bytes(free)}")
    return figures


def _pull_native(hf, repo, commit, asked, shards, files, dst, progress) -> tuple[Path, dict]:
    """The checkpoint itself, downloaded whole into `dst` (run as it is, where the plugin runs its
    native formats), resumable by huggingface_hub's local-directory downloads."""
    from .sizes import format_bytes

    wanted = [n for n in (*COPIED_FILES, INDEX, *shards) if n in files]
    total = sum(files[n] for n in wanted)
    _, free = _free(dst.parent)
    if total > free:
        raise ColibriError(f"the pull needs {format_bytes(total)} free on {dst.parent}; it has {format_bytes(free)}")
    staging = dst.with_name(dst.name + ".partial")
    try:
        hf.snapshot_download(repo, revision=commit, local_dir=staging, allow_patterns=wanted)
    except (hf.errors.HfHubHTTPError, OSError, ValueError) as e:
        raise ColibriError(f"downloading {repo}@{commit[:12]} failed: {' '.join(str(e).split())[:200]}; rerun the "
                           "same command to resume") from None
    (staging / PULL_RECORD).write_text(json.dumps({"repo": repo, "revision": commit, "asked": asked, "quant": "native"}))
    if dst.exists():
        shutil.rmtree(dst)
    os.rename(staging, dst)
    return dst, {"container_bytes": total, "largest_shard": 0, "margin": 0, "peak_bytes": total}


def list_models() -> list[dict]:
    """Every model in `models_dir`: its hub id, revision, architecture, plugin, quantisation, size on
    disk (with its stripe directory's), where its experts are striped ("DIR2 (share)", `colibri
    stripe`) or None; an unfinished pull as such."""
    from .container.streamed import disk_bytes
    from .container.stripe import recorded

    root, out = models_dir(), []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if not d.is_dir():
            continue
        unfinished = d.name.endswith(WORK_SUFFIXES)
        rec = _pulled(d) or {}
        try:
            stripe = recorded(d)
            striped = None if stripe is None else f"{stripe[0]} ({stripe[1]:.2f})"
        except ColibriError:
            stripe, striped = None, "unknown: its stripe record is damaged"
        on_disk = disk_bytes(d, *(() if stripe is None or not stripe[0].is_dir() else (stripe[0],)))
        name = next((d.name.removesuffix(w) for w in WORK_SUFFIXES if d.name.endswith(w)), d.name)
        out.append({"id": rec.get("repo") or name.replace("--", "/", 1),
                    "revision": rec.get("revision"), "architecture": rec.get("architecture"),
                    "plugin": rec.get("plugin"), "quant": rec.get("quant"), "bytes": on_disk,
                    "path": str(d), "striped": striped,
                    "state": "unfinished" if unfinished else "ready" if rec else "unknown"})
    return out


def remove(spec: str) -> list[Path]:
    """Delete the pulled model `spec` ("ORG/NAME") and any unfinished pull of it, with the stripe
    directory its experts are striped into (`colibri stripe`); the paths removed. The stripe
    directory goes first: a removal cut short leaves a model that a second `rm` finishes."""
    from .container.stripe import recorded

    parsed = parse_id(spec)
    if parsed is None:
        raise ColibriError(f"{spec!r} is not a hub id: ORG/NAME")
    path = model_path(parsed[0])
    models = [p for p in (path, *(path.with_name(path.name + w) for w in WORK_SUFFIXES)) if p.exists()]
    if not models:
        raise ColibriError(f"{parsed[0]} is not pulled (nothing in {models_dir()})")
    held = []  # refused while a server or chat has one open
    try:
        for p in models:
            held.append(hold(p / MANIFEST, "removing it"))
        stripes = [s[0] for s in map(recorded, models) if s is not None and s[0].is_dir()]
        for p in stripes + models:
            shutil.rmtree(p)
    finally:
        for fd in held:
            if fd is not None:
                os.close(fd)
    return stripes + models
