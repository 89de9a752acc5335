"""`colibri pull` / `list` / `rm` and `--model ORG/NAME`, against a model hub on localhost
(tests/hubserver.py) with the real huggingface_hub client: a pull writes the container `convert`
writes from the same checkpoint, byte for byte; a pull killed (SIGKILL) at random points, of a
checkpoint or of a GGUF repository, in its download or its conversion, resumes to that same
container and leaves nothing behind in the hub cache; the disk it takes at its peak stays within
the container, the largest shard and the margin it states."""
import filecmp
import json
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from colibri_core.container.reader import MANIFEST
from colibri_core.convert import convert_checkpoint
from hubserver import HubServer, publish, shard

from conftest import COLIBRI, colibri

REPO = "tiny/olmoe"
SHARDS = 4


@pytest.fixture(scope="module")
def hub_repo(tiny_checkpoint, tmp_path_factory):
    """(hub root, commit, the sharded checkpoint it serves, convert's container of it)."""
    tmp = tmp_path_factory.mktemp("hub")
    sharded = shard(tiny_checkpoint, tmp / "sharded", SHARDS)
    where = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    experts = {n.rsplit(".", 2)[0] for n in where if ".experts." in n}
    assert any(len({where[f"{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}) > 1 for e in experts), \
        "the shards cut through an expert (its tensors stashed while the next shard downloads)"
    commit = publish(tmp / "root", REPO, sharded)
    converted = tmp / "converted"
    convert_checkpoint(sharded, converted, "int4", progress=False)
    return tmp / "root", commit, sharded, converted


@pytest.fixture()
def env(hub_repo, tmp_path):
    with HubServer(hub_repo[0]) as server:
        yield {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"),
               "COLIBRI_HOME": str(tmp_path / "colibri"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def container_files(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and not p.name.startswith("."))


def left_in_cache(hf_home: Path) -> list[str]:
    """What a finished pull (not --keep-source) left in the hub cache beyond the small files it
    keeps: an unfinished download, a shard or GGUF, a blob no snapshot names."""
    left = [p for p in hf_home.rglob("*") if p.name.endswith((".incomplete", ".safetensors", ".gguf"))]
    named = {Path(os.path.realpath(p)) for p in hf_home.glob("hub/models--*/snapshots/*/*")}
    return sorted(str(p) for p in {*left, *hf_home.glob("hub/models--*/blobs/*")} - named)


def same_tensors(a: Path, b: Path) -> None:
    """`a` and `b` hold the same resident and expert files, byte for byte."""
    rels = [r for r in container_files(a) if r.endswith((".bin", ".safetensors"))]
    assert rels == [r for r in container_files(b) if r.endswith((".bin", ".safetensors"))]
    for rel in rels:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


def test_pull_then_run_is_convert_then_run(hub_repo, env, tmp_path):
    root, commit, sharded, converted = hub_repo
    r = colibri("pull", REPO, env=env)
    assert r.returncode == 0, r.stderr
    pulled = tmp_path / "colibri" / "models" / "tiny--olmoe"
    same_tensors(pulled, converted)
    assert f"revision: {commit}" in (pulled / MANIFEST).read_text()
    assert not list((tmp_path / "hf").rglob("*.safetensors")), "shards are deleted once written"
    runs = [colibri("run", "--model", m, "--max-tokens", "12", "the quick", env=env) for m in (REPO, converted)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()
    r = colibri("pull", REPO, env=env)
    assert r.returncode == 0 and "pulled already" in r.stderr
    listed = colibri("list", env=env)
    assert listed.returncode == 0 and REPO in listed.stdout and "olmoe" in listed.stdout and "int4" in listed.stdout
    assert colibri("doctor", "--model", REPO, env=env).returncode == 0
    assert colibri("rm", REPO, env=env).returncode == 0
    assert not pulled.exists()
    r = colibri("run", "--model", REPO, "x", env=env)
    assert r.returncode == 1 and f"colibri pull {REPO}" in r.stderr


def test_keep_source_and_revision(hub_repo, env, tmp_path):
    root, commit, _, converted = hub_repo
    r = colibri("pull", f"{REPO}@{commit}", "--keep-source", "--quant", "int8", env=env)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "hf").rglob("model-*.safetensors"))) == SHARDS
    assert colibri("run", "--model", f"{REPO}@{commit}", "--max-tokens", "4", "the", env=env).returncode == 0
    r = colibri("pull", f"{REPO}@nope", env=env)
    assert r.returncode == 1 and "no revision 'nope'" in r.stderr


def test_plan_from_hub_config_alone(hub_repo, env):
    r = colibri("plan", "--model", REPO, "--ram", "1GB", "--disk-bw", "1GB", "--mem-bw", "10GB", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert '"architecture": "olmoe"' in r.stdout


def test_unknown_model_is_one_line(env):
    r = colibri("pull", "nobody/nothing", env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no such model" in r.stderr


def test_a_killed_conversions_folders_are_an_unfinished_pull(tmp_path, monkeypatch):
    """What a kill leaves beside a model (the unfinished container, a GGUF's dequantised blocks) is
    listed as that model's unfinished pull and removed with it."""
    from colibri_core import hub

    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path))
    for suffix in hub.WORK_SUFFIXES:
        (hub.models_dir() / f"tiny--olmoe{suffix}").mkdir(parents=True)
    assert [(m["id"], m["state"]) for m in hub.list_models()] == [("tiny/olmoe", "unfinished")] * 2
    assert len(hub.remove("tiny/olmoe")) == 2 and not any(hub.models_dir().iterdir())


def test_peak_disk_within_the_stated_bound(hub_repo, env, tmp_path):
    """The bytes on disk under the hub cache and the models directory, sampled every millisecond
    through the pull, and the pull's own figure at its moments of most use, are within the
    container + the largest shard + two of the largest tensor (the stash) + the small files."""
    from colibri_core.container.streamed import disk_bytes

    proc = subprocess.Popen([*COLIBRI, "pull", REPO, "--json"], env=env, stdout=subprocess.PIPE, text=True)
    watch = (tmp_path / "hf", tmp_path / "colibri")
    sampled = 0
    while proc.poll() is None:
        sampled = max(sampled, disk_bytes(*watch))
        time.sleep(0.001)
    figures = json.loads(proc.stdout.read())
    assert proc.returncode == 0
    sharded = hub_repo[2]
    small = sum(f.stat().st_size + 4096 for f in sharded.iterdir() if not f.name.endswith(".safetensors"))
    bound = figures["container_bytes"] + figures["largest_shard"] + (figures["margin"] - (64 << 20)) + small
    print(f"peak disk: sampled {sampled}, reported {figures['peak_bytes']}, bound {bound} "
          f"(container {figures['container_bytes']}, largest shard {figures['largest_shard']})")
    assert sampled <= bound and figures["peak_bytes"] <= bound


def test_sweep_spares_a_running_download(tmp_path):
    """What a killed download left in the hub cache (its temporary, huggingface_hub's file-mode
    probe beside it, its symlink probe's folder) is deleted; while another download runs (its blob's lock held), only the
    temporaries of the downloads no one runs are."""
    from types import SimpleNamespace

    from filelock import FileLock

    from colibri_core.hub import _sweep

    hf = SimpleNamespace(constants=SimpleNamespace(HF_HUB_CACHE=str(tmp_path)))
    blobs = tmp_path / "models--tiny--olmoe" / "blobs"
    blobs.mkdir(parents=True)
    (tmp_path / ".locks" / "models--tiny--olmoe").mkdir(parents=True)
    killed, running = blobs / f"{'a' * 64}.0123abcd.incomplete", blobs / f"{'b' * 64}.4567cdef.incomplete"
    probe = blobs / f"tmp_{uuid.uuid4()}"
    for f in (killed, running, probe):
        f.touch()
    symlinks = {}  # huggingface_hub's symlink probes in the cache's root: one a kill left, one running
    for name, age in (("tmpk1ll3d_x", 3600), ("tmpl1ve_now", 0)):
        d = symlinks[name] = tmp_path / name
        d.mkdir()
        (d / "dummy_file_src").touch()
        os.utime(d, (time.time() - age,) * 2)
    with FileLock(tmp_path / ".locks" / "models--tiny--olmoe" / f"{'b' * 64}.lock"):
        _sweep(hf, REPO)
        assert sorted(blobs.iterdir()) == sorted([running, probe])
    _sweep(hf, REPO)
    assert not list(blobs.iterdir())
    assert not symlinks["tmpk1ll3d_x"].exists() and symlinks["tmpl1ve_now"].is_dir()


def kill_trials(hub_repo, tmp_path, trials: int, seed: int) -> int:
    """`trials` pulls, each SIGKILLed at a random moment (through a slowed-down download or the
    conversion), then resumed: every one ends byte-identical to convert's container, and its
    manifest identical to an uninterrupted pull's. Returns how many kills left work half done."""
    rng, interrupted = random.Random(seed), 0
    with HubServer(hub_repo[0], rate=2_000_000) as server:
        def env(i):
            return {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / f"hf{i}"),
                    "COLIBRI_HOME": str(tmp_path / f"c{i}"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        t0 = time.monotonic()
        assert colibri("pull", REPO, env=env("ref")).returncode == 0
        span = time.monotonic() - t0
        reference = tmp_path / "cref" / "models" / "tiny--olmoe"
        for i in range(trials):
            for _ in range(rng.randint(1, 2)):  # killed once or twice before the run that finishes
                proc = subprocess.Popen([*COLIBRI, "pull", REPO], env=env(i), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
                time.sleep(rng.uniform(0.3, 1.0) * span)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                interrupted += any((tmp_path / f"c{i}").rglob("*.partial")) or any((tmp_path / f"hf{i}").rglob("*.incomplete"))
            r = colibri("pull", REPO, env=env(i))
            assert r.returncode == 0, r.stderr
            pulled = tmp_path / f"c{i}" / "models" / "tiny--olmoe"
            same_tensors(pulled, hub_repo[3])
            assert (pulled / MANIFEST).read_bytes() == (reference / MANIFEST).read_bytes()
            left = left_in_cache(tmp_path / f"hf{i}")
            assert not left, f"trial {i}: left in the hub cache: {left}"
            assert [p.name for p in pulled.parent.iterdir()] == [pulled.name], f"trial {i}: left beside the model"
    print(f"{trials} pulls, {interrupted} kills left a download or conversion half done")
    return interrupted


def test_kill_during_pull_resumes_identically(hub_repo, tmp_path):
    kill_trials(hub_repo, tmp_path, 3, seed=1)


@pytest.mark.system
def test_kill_during_pull_resumes_identically_many(hub_repo, tmp_path):
    assert kill_trials(hub_repo, tmp_path, 20, seed=2) >= 10


# ----------------------------------------------------------------------------- GGUF repositories

GGUF_REPO = "tiny/olmoe-gguf"


@pytest.fixture(scope="module")
def gguf_hub(tmp_path_factory):
    """(hub root, the GGUFs it serves): a tiny OLMoE at Q8_0 and Q4_0, and at F16 split in parts, in
    one repository, named as llama.cpp's converter and gguf-split name them."""
    pytest.importorskip("gguf", reason="the bench extra (gguf) writes the GGUF files")
    from colibri_olmoe.demo import write_checkpoint, write_tokenizer
    from test_gguf_in import write_gguf

    tmp = tmp_path_factory.mktemp("gguf-hub")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    eos = write_tokenizer(ckpt, ["the quick brown fox jumps over the lazy dog " * 20, "colibri streams experts"], 300)
    write_checkpoint(ckpt, vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_experts=8, num_experts_per_tok=2, eos_token_id=eos)
    files = tmp / "files"
    files.mkdir()
    for qtype in ("Q8_0", "Q4_0"):
        write_gguf(ckpt, files / f"Tiny-OLMoE-{qtype}.gguf", qtype)
    write_gguf(ckpt, files / "Tiny-OLMoE-F16.gguf", "F16", split=12)
    assert len(list(files.glob("Tiny-OLMoE-F16-*-of-*.gguf"))) > 1
    (files / "README.md").write_text("a GGUF repository\n")
    publish(tmp / "root", GGUF_REPO, files)
    return tmp / "root", files


@pytest.fixture()
def gguf_env(gguf_hub, tmp_path):
    with HubServer(gguf_hub[0]) as server:
        yield {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"),
               "COLIBRI_HOME": str(tmp_path / "colibri"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def test_pull_gguf_by_quantisation(gguf_hub, gguf_env, tmp_path):
    """ORG/NAME:QUANT (case-insensitive) pulls that GGUF and converts it: the container `colibri
    convert` makes of the same file; the GGUF is deleted once converted; run finds it by hub id."""
    _, files = gguf_hub
    r = colibri("plan", "--model", GGUF_REPO, "--ram", "1GB", "--disk-bw", "1GB", "--mem-bw", "10GB", env=gguf_env)
    assert r.returncode == 1 and "a GGUF repository is planned once pulled" in r.stderr, r.stderr
    r = colibri("pull", f"{GGUF_REPO}:q4_0", "--json", env=gguf_env)
    assert r.returncode == 0, r.stderr
    assert "requantised" in r.stderr and json.loads(r.stdout)["gguf"] == ["Tiny-OLMoE-Q4_0.gguf"]
    assert colibri("convert", files / "Tiny-OLMoE-Q4_0.gguf", tmp_path / "converted").returncode == 0
    pulled = tmp_path / "colibri" / "models" / "tiny--olmoe-gguf"
    same_tensors(pulled, tmp_path / "converted")
    assert not list((tmp_path / "hf").rglob("*.gguf")), "the GGUF is deleted once converted"
    for model in (GGUF_REPO, f"{GGUF_REPO}:Q4_0"):
        r = colibri("run", "--model", model, "--max-tokens", "4", "the quick", env=gguf_env)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = colibri("run", "--model", f"{GGUF_REPO}:Q8_0", "x", env=gguf_env)
    assert r.returncode == 1 and "pulled from Q4_0, not Q8_0" in r.stderr
    work = pulled.with_name(pulled.name + ".gguf-work")  # as a kill between publishing and its removal leaves it
    (work / "files").mkdir(parents=True)
    r = colibri("pull", f"{GGUF_REPO}:Q4_0", env=gguf_env)
    assert r.returncode == 0 and "pulled already" in r.stderr
    assert not work.exists(), "the pull that finds the model whole removes its conversion's work folder"
    listed = colibri("list", env=gguf_env)
    assert GGUF_REPO in listed.stdout and "int4" in listed.stdout


def test_pull_split_gguf(gguf_hub, gguf_env, tmp_path):
    """A GGUF split in parts is pulled whole (every part) and converted as one file."""
    _, files = gguf_hub
    r = colibri("pull", f"{GGUF_REPO}:F16", "--quant", "int8", "--keep-source", env=gguf_env)
    assert r.returncode == 0, r.stderr
    parts = sorted(files.glob("Tiny-OLMoE-F16-*-of-*.gguf"))
    assert sorted(p.name for p in (tmp_path / "hf").rglob("*.gguf") if p.is_symlink()) == [p.name for p in parts]
    assert colibri("convert", parts[0], tmp_path / "converted", "--quant", "int8").returncode == 0
    same_tensors(tmp_path / "colibri" / "models" / "tiny--olmoe-gguf", tmp_path / "converted")
    r = colibri("convert", parts[1], tmp_path / "second", env=gguf_env)
    assert r.returncode == 1 and "give its first part" in r.stderr


@pytest.mark.parametrize("spec,message", [
    (GGUF_REPO, f"{GGUF_REPO} holds GGUF files of several quantisations: name one, {GGUF_REPO}:QUANT (F16, Q4_0, Q8_0)"),
    (f"{GGUF_REPO}:Q4_K_M", f"{GGUF_REPO} has no Q4_K_M GGUF file; its quantisations: F16, Q4_0, Q8_0"),
    (f"{REPO}:Q4_0", f"{REPO} has no Q4_0 GGUF file; its quantisations: none"),
])
def test_gguf_quantisation_absent_or_ambiguous_is_one_line(hub_repo, gguf_hub, tmp_path, spec, message):
    import shutil

    root = tmp_path / "root"  # both repositories on one hub
    for hub in (hub_repo[0], gguf_hub[0]):
        shutil.copytree(hub, root, dirs_exist_ok=True)
    with HubServer(root) as server:
        r = colibri("pull", spec, env={**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf"),
                                       "COLIBRI_HOME": str(tmp_path / "colibri")})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.rstrip().endswith(message), r.stderr


def gguf_kill_trials(gguf_hub, tmp_path, trials: int, seed: int) -> dict[str, int]:
    """`trials` GGUF pulls, the single-file Q8_0 and the split F16 in turn, each SIGKILLed once or
    twice (at a random moment of the download, through a slowed-down server, or of the conversion),
    then resumed: every one ends with the container an uninterrupted pull writes, its manifest and
    every file byte for byte, and nothing else left behind (no GGUF nor unfinished download in the
    hub cache, no unfinished or temporary directory beside the model). Returns where the kills
    landed: "download" (a file cut short), "conversion" (the container's pieces being written),
    "between" (hashing and reading the GGUF, or between two files), "start" (before the pull
    began), "published" (the container in place, the GGUF not yet deleted)."""
    rng, hits = random.Random(seed), dict.fromkeys(("start", "download", "between", "conversion", "published"), 0)
    with HubServer(gguf_hub[0], rate=500_000) as server:
        def pull(i, quant: str) -> tuple[subprocess.Popen, Path]:
            log = tmp_path / f"pull{i}.log"
            env = {**os.environ, "HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / f"hf{i}"),
                   "COLIBRI_HOME": str(tmp_path / f"c{i}"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
            with open(log, "w") as err:
                return subprocess.Popen([*COLIBRI, "pull", f"{GGUF_REPO}:{quant}"], env=env,
                                        stdout=subprocess.DEVNULL, stderr=err), log

        spans = {}
        for quant in ("Q8_0", "F16"):  # the references, timing each phase
            proc, log = pull(f"ref-{quant}", quant)
            models = tmp_path / f"cref-{quant}" / "models"  # made once every part has landed
            marks = [_moment(proc, lambda: "pulling" in log.read_text()), _moment(proc, models.is_dir),
                     _moment(proc, lambda: "converting" in log.read_text()),
                     _moment(proc, (models / "tiny--olmoe-gguf" / MANIFEST).is_file)]
            assert proc.wait() == 0 and None not in marks, log.read_text()
            spans[quant] = {"download": marks[1] - marks[0], "conversion": marks[3] - marks[2]}
        for i in range(trials):
            quant = ("Q8_0", "F16")[i % 2]
            reference = tmp_path / f"cref-{quant}" / "models" / "tiny--olmoe-gguf"
            pulled = tmp_path / f"c{i}" / "models" / "tiny--olmoe-gguf"
            blobs = tmp_path / f"hf{i}" / "hub" / "models--tiny--olmoe-gguf" / "blobs"
            for kill in range(rng.randint(1, 2)):  # killed once or twice before the run that finishes
                # the first kill aimed at each phase in turn for each file; a second one, at either
                phase = ("download", "conversion")[i // 2 % 2] if kill == 0 else rng.choice(("download", "conversion"))
                cut_before = set(blobs.glob("*.incomplete"))
                proc, log = pull(i, quant)
                _moment(proc, lambda: ("pulling", "converting")[phase == "conversion"] in log.read_text())
                time.sleep(rng.uniform(0, 0.9) * spans[quant][phase])
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                said = log.read_text()
                hits["published" if (pulled / MANIFEST).is_file() else "conversion" if "converting" in said else
                     "download" if set(blobs.glob("*.incomplete")) - cut_before else
                     "between" if "pulling" in said else "start"] += 1
            proc, log = pull(i, quant)
            assert proc.wait() == 0, log.read_text()
            assert container_files(pulled) == container_files(reference)
            for rel in container_files(reference):
                assert filecmp.cmp(pulled / rel, reference / rel, shallow=False), rel
            assert [p.name for p in pulled.parent.iterdir()] == [pulled.name], f"trial {i}: left beside the model"
            left = left_in_cache(tmp_path / f"hf{i}")
            assert not left, f"trial {i}: left in the hub cache: {left}"
    print(f"{trials} GGUF pulls, kills: {hits}; phases (s): {spans}")
    return hits


def _moment(proc, ready) -> float | None:
    """When `ready()` first holds (polled every millisecond) while `proc` runs; None if it never did."""
    while not ready():
        if proc.poll() is not None:
            return None
        time.sleep(0.001)
    return time.monotonic()


def test_kill_during_gguf_pull_resumes_identically(gguf_hub, tmp_path):
    gguf_kill_trials(gguf_hub, tmp_path, 4, seed=1)


@pytest.mark.system
def test_kill_during_gguf_pull_resumes_identically_many(gguf_hub, tmp_path):
    hits = gguf_kill_trials(gguf_hub, tmp_path, 20, seed=2)
    assert hits["download"] >= 5 and hits["conversion"] >= 5, hits
