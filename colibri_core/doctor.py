"""`colibri doctor`: read-only checks of the installation and of one model directory.

Each check is one line, PASS / WARN / FAIL and what was found; any FAIL makes the exit status 1.
Nothing is written (not even the routing history).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ColibriError


@dataclass
class Check:
    name: str
    status: str  # "PASS" | "WARN" | "FAIL"
    detail: str

    def line(self) -> str:
        return f"{self.status:4}  {self.name}: {self.detail}"


def run_checks(model_dir: str | Path, deep: bool = False, ray: str | None = None, ray_paths: dict | None = None,
               ray_default_path: str | None = None) -> list[Check]:
    model_dir = Path(model_dir)
    checks: list[Check] = []

    def add(name, ok, detail, warn=False):
        checks.append(Check(name, "PASS" if ok else ("WARN" if warn else "FAIL"), detail))

    try:
        from . import kernels

        add("kernels", True, f"C kernels built, SIMD path {kernels.simd()}")
    except ImportError as e:
        add("kernels", False, f"not built ({e})")

    from . import plugins
    from .convert import read_config

    container = arch = None
    try:
        config = read_config(model_dir)
        served = plugins.registry().resolve(config, where=str(model_dir))
        arch, model_cls = served, plugins.registry().model_class(served)  # both, or neither (a broken model module)
        add("plugin", True, f"{arch.name} served by {arch.plugin} {arch.version}")
    except ColibriError as e:
        add("plugin", False, str(e))
    from .container import Container
    from .container.native import NativeCheckpoint, is_checkpoint
    from .container.reader import MANIFEST
    from .convert import generation_defaults, parse_config

    native = is_checkpoint(model_dir) and not (model_dir / MANIFEST).exists()  # run serves it as it is
    try:
        if not native:
            container = Container(model_dir)
            add("files", True, f"every file the manifest lists is present with its recorded size; small files' "
                               f"checksums match ({len(container.moe_layers)} expert files)")
        elif arch is not None:  # read through the layout its config.json gives
            container = NativeCheckpoint(model_dir, model_cls.layout(parse_config(model_cls, config, model_dir)),
                                         arch.name)
            generation_defaults(model_dir)  # its token ids, as `run` reads them (a container checksums the file)
            add("files", True, f"a checkpoint run as it is: every tensor the {arch.name} layout needs is there, "
                               f"every shard as long as its header says ({len(container.moe_layers)} MoE layers); "
                               f"it carries no checksums (`colibri convert` writes them)")
    except ColibriError as e:
        add("files", False, str(e))
    if isinstance(container, Container) and arch is not None:  # what `run` checks before loading anything
        try:
            if arch.name != container.architecture:
                raise ColibriError(f"the container is for architecture {container.architecture}, but config.json "
                                   f"is served by {arch.name} ({arch.plugin})")
            model_cls.layout(parse_config(model_cls, container.config, model_dir))
            add("config", True, f"config.json parses as {arch.name} and matches the container")
        except ColibriError as e:
            add("config", False, str(e))

    from .sizes import available_memory, format_bytes

    where = next(p for p in (model_dir, *model_dir.absolute().parents) if p.is_dir())  # a path that may not exist
    free = shutil.disk_usage(where).free
    add("free disk", free >= 100 * 10**6, f"{format_bytes(free)} free beside the model", warn=True)
    ram = available_memory()
    if isinstance(container, Container):
        need = container.resident_nbytes + sum(container.layer_expert_nbytes(layer) for layer in container.moe_layers)
        add("RAM", ram >= need, f"{format_bytes(ram)} available; the model needs at least {format_bytes(need)} "
                                f"(resident weights + one expert per layer)")
        from .store import io
        from .store import stripe as stripe_mod

        stripe = container.stripe  # experts striped across two disks: its files checked present as it opened
        if stripe is not None:
            found = stripe_mod.problems(container, stripe, deep=False)
            add("stripe", not found, found[0] if found else stripe_mod.summary(container, stripe) +
                "; its files present with their sizes, sampled extents match the manifest")
        path, _, nbytes = container.expert_location(container.moe_layers[0], 0)
        fd, refused = io.open_expert_file(path, True, probe_bytes=nbytes)
        io.close_fd(fd)
        add("O_DIRECT", refused is None, "supported: --direct reads bypass the page cache" if refused is None
            else f"refused by the filesystem ({refused}): --direct falls back to the page cache", warn=True)
        from .store.usage import USAGE_FILE, UsageHistory
        import warnings

        if (model_dir / USAGE_FILE).exists():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                h = UsageHistory(container)
            add("routing history", not caught, f"{h.tokens} tokens recorded" if not caught
                else str(caught[0].message), warn=True)
        if deep:  # a striped container's extents read from the file that holds each
            problems = container.verify(deep=True)
            add("checksums (deep)", not problems, "every expert extent and file matches the manifest" if not problems
                else f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        container.close()
    else:
        add("RAM", True, f"{format_bytes(ram)} available", warn=True)
        if container is not None:  # a checkpoint run as it is
            if deep:
                add("checksums (deep)", False, "a checkpoint carries no checksums to check; `colibri convert` "
                                               "writes them", warn=True)
            container.close()
    if ray is not None:
        from .remote.doctor import ray_checks

        for name, status, detail in ray_checks(ray, model_dir, ray_paths or {}, ray_default_path):
            checks.append(Check(name, status, detail))
    return checks
