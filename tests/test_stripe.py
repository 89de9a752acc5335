"""Weighted striping across two disks (colibri_core/store/stripe.py): a share of every layer's
experts moved to a second directory, each read from the file that holds it; the tokens are those of
the model never striped, a crash at any step leaves a placement that reads right, `--undo` gives
back the original files byte for byte, and doctor, plan and --stats say where the experts are."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_core import load
from colibri_core.doctor import run_checks
from colibri_core.errors import ColibriError
from colibri_core.container.stripe import STRIPE_FILE
from colibri_core.planning import stripe_share
from colibri_core.store import stripe as stripe_mod

from conftest import colibri, resident_baseline, store_model

PROMPT = list(range(3, 23))
N_NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """4 MoE layers × 16 experts, top-2 (as test_store's)."""
    return store_model(tmp_path_factory.mktemp("stripe"))


@pytest.fixture(scope="module")
def baseline(model):
    """Logits and greedy tokens of the model never striped, every expert resident."""
    return resident_baseline(model, PROMPT, N_NEW, slots=16)


@pytest.fixture
def copy(model, tmp_path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "m"))


def expert_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((model_dir / "experts").iterdir())}


def check_same(model_dir, baseline, **options) -> dict:
    """The striped model's logits bit-identical and tokens identical to the baseline's; its stats."""
    with load(model_dir, usage=False, **options) as e:
        assert np.array_equal(e.logits(PROMPT), baseline[0])
        assert e.generate(PROMPT, N_NEW, stop_ids=()) == baseline[1]
        return e.stats()


@pytest.mark.parametrize("slots", [2, 16])
def test_striped_tokens_are_those_of_the_model_on_one_disk(copy, baseline, tmp_path, slots):
    blocks = {p.name: p.stat().st_blocks for p in (copy / "experts").iterdir()}
    s = stripe_mod.stripe(copy, tmp_path / "dir2", 0.4)
    assert s.directory.parent == tmp_path / "dir2" and sorted(s.moved) == [0, 1, 2, 3]
    assert all(len(experts) == round(0.4 * 16) for experts in s.moved.values())
    for p in (copy / "experts").iterdir():  # the moved extents' space is freed here, held there
        assert p.stat().st_blocks < blocks[p.name]
    assert all(Path(s.path(layer)).stat().st_blocks < blocks[f"layer-{layer:03d}.bin"] for layer in s.moved)
    stats = check_same(copy, baseline, cache_slots=slots)
    assert stats["stripe"] == str(s.directory) and stats["stripe_share"] == 0.4
    disks = stats["disks"]
    assert set(disks) == {"primary", "stripe"}, disks
    assert all(d["bytes"] > 0 and d["reads"] > 0 and d["read_seconds"] > 0 for d in disks.values())
    assert sum(d["bytes"] for d in disks.values()) == stats["bytes_read"]


def test_undo_gives_back_the_original_files_byte_for_byte(copy, baseline, tmp_path):
    before = expert_files(copy)
    stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    assert expert_files(copy) != before  # the moved extents read as holes here now
    stripe_mod.unstripe(copy)
    assert expert_files(copy) == before
    assert not (copy / STRIPE_FILE).exists() and list((tmp_path / "dir2").iterdir()) == []
    assert check_same(copy, baseline, cache_slots=2)["stripe"] is None
    with pytest.raises(ColibriError, match="is not striped"):
        stripe_mod.unstripe(copy)


class Crash(Exception):
    """A process killed between two steps (raised in place of the step)."""


def crash_at(monkeypatch, step: str, call: int) -> None:
    """Make the `call`-th call of stripe.py's `step` (0: the first) raise Crash before it runs."""
    real, calls = getattr(stripe_mod, step), []

    def step_or_crash(*args, **kw):
        calls.append(1)
        if len(calls) == call + 1:
            raise Crash(step)
        return real(*args, **kw)

    monkeypatch.setattr(stripe_mod, step, step_or_crash)


@pytest.mark.parametrize("step,call", [("_copy_extents", 2), ("save", 2), ("_punch", 1), ("_punch", 3)])
def test_a_crash_while_striping_leaves_a_placement_that_reads_right(copy, baseline, tmp_path, monkeypatch,
                                                                    step, call):
    """Killed before any step of any layer (copy, record, free): the model reads the baseline's
    tokens as it is, doctor --deep passes, and rerunning the command finishes the stripe."""
    crash_at(monkeypatch, step, call)
    with pytest.raises(Crash):
        stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    monkeypatch.undo()
    check_same(copy, baseline, cache_slots=2)
    assert all(c.status == "PASS" for c in run_checks(copy, deep=True) if c.name not in ("free disk", "O_DIRECT"))
    s = stripe_mod.stripe(copy, tmp_path / "dir2", "auto")  # finished with the share it was begun with
    assert s.share == 0.5 and sorted(s.moved) == [0, 1, 2, 3]
    check_same(copy, baseline, cache_slots=2)


def test_a_torn_copy_in_the_stripe_directory_is_never_trusted(copy, baseline, tmp_path, monkeypatch):
    """A crash that left a half-written temporary file there: not recorded, so not read; the rerun
    writes it again."""
    crash_at(monkeypatch, "save", 1)  # layer 0's copy in place, its record not written
    with pytest.raises(Crash):
        stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    monkeypatch.undo()
    target = next((tmp_path / "dir2").iterdir())
    (target / "layer-000.bin").write_bytes(b"torn")
    (target / "layer-001.bin.tmp").write_bytes(b"torn")
    check_same(copy, baseline, cache_slots=2)
    stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    check_same(copy, baseline, cache_slots=2)


@pytest.mark.parametrize("step,call", [("_copy_extents", 1), ("save", 1)])
def test_a_crash_while_undoing_leaves_a_placement_that_reads_right(copy, baseline, tmp_path, monkeypatch, step,
                                                                   call):
    before = expert_files(copy)
    stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    crash_at(monkeypatch, step, call)
    with pytest.raises(Crash):
        stripe_mod.unstripe(copy)
    monkeypatch.undo()
    check_same(copy, baseline, cache_slots=2)
    stripe_mod.unstripe(copy)
    assert expert_files(copy) == before


def test_a_damaged_or_missing_stripe_is_an_error_never_a_wrong_token(copy, baseline, tmp_path):
    s = stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    layer, expert = 1, sorted(s.moved[1])[0]
    nbytes = os.stat(s.path(layer)).st_size // 16
    with open(s.path(layer), "r+b") as f:  # one byte of a moved extent
        f.seek(expert * nbytes + 100)
        b = f.read(1)
        f.seek(expert * nbytes + 100)
        f.write(bytes([b[0] ^ 0x40]))
    deep = {c.name: c for c in run_checks(copy, deep=True)}
    assert deep["checksums (deep)"].status == "FAIL" and f"layer {layer} expert {expert}" in deep["checksums (deep)"].detail
    with load(copy, cache_slots=16, usage=False) as e, pytest.raises(ColibriError, match="corrupt expert data"):
        e.store.get(layer, expert)
    os.unlink(s.path(2))
    with pytest.raises(ColibriError, match="layer-002.bin .*is missing: restore it"):
        load(copy, cache_slots=2, usage=False)
    files = {c.name: c for c in run_checks(copy)}["files"]  # the container does not open without its stripe
    assert files.status == "FAIL" and "layer-002.bin (striped experts of" in files.detail
    record = copy / STRIPE_FILE
    record.write_text(record.read_text().replace('"share": 0.5', '"share": 0.6'))
    with pytest.raises(ColibriError, match="fails its checksum"):
        load(copy, cache_slots=2, usage=False)


def test_readers_outside_the_store_follow_the_stripe(model, copy, tmp_path):
    """`read_expert` (remote shards), `dequantize`, whole-extent reads at `expert_location` (`colibri
    bench model`) and `verify --deep` read each expert from the file that holds it: the same
    tensors as the model never striped, no checksum error on a moved expert's hole."""
    from colibri_core.container import Container
    from colibri_core.container.dequant import dequantize
    from colibri_core.quant import dequantize as widen

    s = stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    with Container(model) as plain, Container(copy) as c:
        assert c.stripe == s
        for layer in c.moe_layers:
            for e in range(c.n_experts):
                path, offset, nbytes = c.expert_location(layer, e)
                assert path == (s.path(layer) if e in s.moved[layer] else c.expert_file(layer))
                fd = os.open(path, os.O_RDONLY)
                try:  # what bench model's reads do: a pread at expert_location, checked
                    c.expert_views(os.pread(fd, nbytes, offset), layer, e)
                finally:
                    os.close(fd)
                for got, want in zip(c.read_expert(layer, e), plain.read_expert(layer, e)):
                    assert np.array_equal(widen(got), widen(want))
        assert c.verify(deep=True) == []
    want, got = dequantize(model), dequantize(copy)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    deep = {c.name: c.status for c in run_checks(copy, deep=True)}
    assert deep["checksums (deep)"] == deep["stripe"] == deep["files"] == "PASS", deep


def test_plan_probes_the_disks_decode_reads_never_a_hole(copy, tmp_path, monkeypatch):
    """plan's disk probe reads whole expert extents from the file that holds each (both directories
    of a striped model, together): every byte it reads is an extent the manifest vouches for."""
    from colibri_core import planning
    from colibri_core.container import Container
    from colibri_core.container.reader import extent_crc

    s = stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    probed, real = [], planning.read_bandwidth
    monkeypatch.setattr(planning, "read_bandwidth", lambda extents, *a: probed.extend(extents) or real(extents, *a))
    p = planning.report(model=copy, mem_bw="10GB")
    assert p["disk_bandwidth"] > 0 and p["disk_bandwidth_directories"] == [str(copy), str(s.directory)]
    assert f"read from {copy} and {s.directory} together" in planning.format_report(p)
    with Container(copy) as c:
        crcs = {f["layer"]: f["extent_crc32"] for f in c.manifest["experts"]["files"]}
        where = {c.expert_location(layer, e): (layer, e) for layer in c.moe_layers for e in range(c.n_experts)}
    both = {path for layer in c.moe_layers for path in (c.expert_file(layer), s.path(layer))}
    assert {path for path, _, _ in probed} == both
    for path, offset, nbytes in probed:
        layer, e = where[path, offset, nbytes]
        with open(path, "rb") as f:
            f.seek(offset)
            assert extent_crc(f.read(nbytes)) == crcs[layer][e], (path, layer, e)


def test_rm_removes_the_stripe_directory_too(copy, tmp_path, monkeypatch):
    """`colibri rm` of a pulled model striped into DIR2: the model and DIR2/colibri-stripe-ID go, DIR2
    stays; `colibri list` says where it is striped, and counts both directories' bytes."""
    from colibri_core import hub
    from colibri_core.container.streamed import disk_bytes

    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
    pulled = hub.model_path("org/tiny")
    pulled.parent.mkdir(parents=True)
    shutil.move(copy, pulled)
    s = stripe_mod.stripe(pulled, tmp_path / "dir2", 0.5)
    (listed,) = hub.list_models()
    assert listed["striped"] == f"{s.directory} (0.50)"
    assert listed["bytes"] == disk_bytes(pulled) + disk_bytes(s.directory) > disk_bytes(pulled)
    assert hub.remove("org/tiny") == [s.directory, pulled]
    assert not pulled.exists() and not s.directory.exists() and (tmp_path / "dir2").is_dir()


def holder(model_dir: Path, exclusive: bool = False) -> subprocess.Popen:
    """Another process holding `model_dir` open as an engine does (a Container), or exclusively as
    `colibri stripe` does, until its stdin closes."""
    code = ("import sys; from colibri_core.container import Container; c = Container(sys.argv[1]); "
            + ("c.exclusive('x'); " if exclusive else "") + "print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(model_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline() == "held\n"
    return p


def test_a_model_open_elsewhere_is_never_rearranged(copy, baseline, tmp_path, monkeypatch):
    """stripe, --undo and rm refuse, in one line and touching nothing, a model another process has
    open (a server); a model being striped is not opened meanwhile; once the other lets go, each runs."""
    from colibri_core import hub

    before = expert_files(copy)
    p = holder(copy)
    try:
        with pytest.raises(ColibriError, match=r"open elsewhere \(a server, chat or run uses it\): stop that before "
                                               r"striping it"):
            stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    finally:
        p.communicate("")
    assert expert_files(copy) == before and not (tmp_path / "dir2").exists()
    s = stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    p = holder(copy, exclusive=True)
    try:
        with pytest.raises(ColibriError, match="being changed by another process .*: wait for it to finish"):
            load(copy, usage=False)
    finally:
        p.communicate("")
    with load(copy, usage=False) as e:  # open here: the same refusal
        with pytest.raises(ColibriError, match="stop that before bringing its experts back"):
            stripe_mod.unstripe(copy)
        e.generate(PROMPT, 2, stop_ids=())
    check_same(copy, baseline)
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
    pulled = hub.model_path("org/tiny")
    pulled.parent.mkdir(parents=True)
    shutil.move(copy, pulled)
    p = holder(pulled)
    try:
        with pytest.raises(ColibriError, match="stop that before removing it"):
            hub.remove("org/tiny")
    finally:
        p.communicate("")
    assert pulled.is_dir() and s.directory.is_dir()
    assert hub.remove("org/tiny") == [s.directory, pulled]


def test_share_refusals(copy, tmp_path):
    with pytest.raises(ColibriError, match="between 0 and 1"):
        stripe_mod.stripe(copy, tmp_path / "dir2", 1.5)
    with pytest.raises(ColibriError, match="moves none of a layer's 16 experts"):
        stripe_mod.stripe(copy, tmp_path / "dir2", 0.01)
    with pytest.raises(ColibriError, match="inside the model directory"):
        stripe_mod.stripe(copy, copy / "more", 0.5)
    stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    with pytest.raises(ColibriError, match="striped at share 0.5 already"):
        stripe_mod.stripe(copy, tmp_path / "dir2", 0.25)
    with pytest.raises(ColibriError, match="striped into .* already"):
        stripe_mod.stripe(copy, tmp_path / "elsewhere", 0.5)


def test_auto_share_follows_the_measured_bandwidths(copy, baseline, tmp_path, monkeypatch):
    """auto: each directory's disk measured, the share in proportion (here the two measurements
    replaced by figures of 3 and 1 GB/s: the second directory takes a quarter)."""
    measured = []

    def bandwidth(directory, nbytes=64 << 20):
        measured.append(Path(directory))
        return (1e9 if Path(directory) == tmp_path / "dir2" else 3e9), True

    monkeypatch.setattr("colibri_core.planning.disk_bandwidth_at", bandwidth)
    s = stripe_mod.stripe(copy, tmp_path / "dir2", measure=stripe_share)
    assert measured == [copy, tmp_path / "dir2"] * 3  # the median of three rounds
    assert s.share == 0.25 and s.bandwidth == {"model": 3e9, "stripe": 1e9}
    assert all(len(experts) == 4 for experts in s.moved.values())
    check_same(copy, baseline, cache_slots=2)


def test_stripe_with_a_mirror(copy, baseline, tmp_path):
    """A mirror (a whole copy made before striping) and a stripe together: every expert from one of the three files."""
    mirror = shutil.copytree(copy, tmp_path / "mirror")
    stripe_mod.stripe(copy, tmp_path / "dir2", 0.5)
    with load(copy, cache_slots=2, mirror=mirror, usage=False) as e:
        e.store.primary_share = 0.5
        assert np.array_equal(e.logits(PROMPT), baseline[0]) and e.generate(PROMPT, N_NEW, stop_ids=()) == baseline[1]
        assert len(e.stats()["disks"]) == 3


def test_on_two_tmpfs_mounts(model, baseline, tmp_path):
    """Two filesystems of their own (tmpfs mounts, where this user may mount them): the same tokens."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128M", "tmpfs", str(d)], capture_output=True).returncode:
            pytest.skip("this user cannot mount a tmpfs: the two-directory tests cover striping on one filesystem")
    try:
        m = Path(shutil.copytree(model, a / "m"))
        s = stripe_mod.stripe(m, b, "auto", measure=stripe_share)
        assert os.stat(m).st_dev != os.stat(s.directory).st_dev and 0 < s.share < 1
        stats = check_same(m, baseline, cache_slots=2)
        assert len(stats["disks"]) == 2
    finally:
        for d in (a, b):
            subprocess.run(["umount", str(d)], check=True)


def test_cli_convert_stripe_run_stats_plan_doctor_undo(tiny_checkpoint, tmp_path):
    dst, dir2 = tmp_path / "m", tmp_path / "dir2"
    r = colibri("convert", tiny_checkpoint, dst, "--stripe", dir2, "--share", "0.5")
    assert r.returncode == 0, r.stderr
    assert f"in {dir2}/colibri-stripe-" in r.stderr and "share 0.50 as given" in r.stderr
    r = colibri("run", "--model", dst, "--max-tokens", "4", "--stats", "the quick")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("\ndisk ") == 2 and f"stripe {dir2}/colibri-stripe-" in r.stderr, r.stderr
    r = colibri("plan", "--model", dst, "--disk-bw", "1GB", "--mem-bw", "10GB")
    assert r.returncode == 0 and "stripe: " in r.stdout and str(dir2) in r.stdout, r.stdout + r.stderr
    r = colibri("doctor", "--model", dst, "--deep")
    assert r.returncode == 0 and "PASS  stripe:" in r.stdout, r.stdout
    r = colibri("stripe", dst, "--share", "half")
    assert r.returncode == 1 and "name the directory" in r.stderr
    r = colibri("stripe", dst, dir2, "--share", "half")
    assert r.returncode == 1 and "--share must be auto or a number" in r.stderr
    r = colibri("stripe", dst, "--undo")
    assert r.returncode == 0 and "back in the model directory" in r.stderr, r.stderr
    assert not (dst / STRIPE_FILE).exists()
