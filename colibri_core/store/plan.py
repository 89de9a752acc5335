"""`colibri plan`: how a model would sit in a RAM budget, from a converted directory or from its
config.json alone (a model you have not downloaded), and the floor times the machine allows.

Expected bytes read per token assume uniform routing (each of a token's layers × top-k experts is
resident with probability cached / all experts): an upper bound, since real routing is skewed and
the hot-store pins the popular experts. The floors: disk = those bytes ÷ disk bandwidth; memory =
the bytes the kernels touch per token (dense weights + layers × top-k experts) ÷ memory bandwidth.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .. import planning, plugins
from ..convert import parse_config
from ..errors import ColibriError
from ..fsio import read_json
from .budget import experts_fit, split_budget
from .usage import UsageHistory


@dataclass
class ModelSizes:
    architecture: str
    quant: str
    dense_bytes: int  # resident weights
    expert_nbytes: int  # one expert's extent on disk (and in RAM)
    moe_layers: int
    n_experts: int  # per MoE layer
    top_k: int  # experts per token per layer
    state_bytes_per_token: int  # at the KV cache type below
    kv_cache: str = "f32"  # the KV caches' element type the state is sized for (`load(kv_cache=...)`)

    @property
    def experts_total(self) -> int:
        return self.moe_layers * self.n_experts


def sizes_from_container(model_dir: str | Path, kv_cache: str = "f32") -> ModelSizes:
    from ..container import Container

    c = Container(model_dir)
    reg = plugins.registry()
    arch = reg.resolve(c.config, where=str(model_dir))
    model_cls = reg.model_class(arch)
    cfg = parse_config(model_cls, c.config, model_dir)
    measured = planning.measured(model_dir)
    return ModelSizes(arch.name, c.quant, measured["resident_bytes"], c.expert_nbytes, len(c.moe_layers),
                      c.n_experts, model_cls.layout(cfg).top_k, planning.state_bytes_per_token(model_cls, cfg, kv_cache),
                      kv_cache)


def sizes_from_config(config_path: str | Path, quant_kind: str, kv_cache: str = "f32") -> tuple[ModelSizes, dict]:
    """The sizes `make_plan` needs, and `planning.plan`'s full report, from config.json alone."""
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise ColibriError(f"{config_path} is not a model configuration (a JSON object)")
    reg = plugins.registry()
    arch = reg.resolve(config, where=str(config_path))
    model_cls = reg.model_class(arch)
    cfg = parse_config(model_cls, config, config_path)
    try:
        report = planning.plan(model_cls, cfg, quant_kind, kv_cache)
    except NotImplementedError:
        raise ColibriError(f"plugin {arch.plugin} cannot plan {arch.name} from config.json alone; "
                           f"convert the model and use --model") from None
    sizes = ModelSizes(arch.name, quant_kind, report["resident_bytes"], report["expert_bytes"], report["moe_layers"],
                       report["experts_per_layer"], report["top_k"], report["state_bytes_per_token"], kv_cache)
    return sizes, report


def make_plan(sizes: ModelSizes, budget: int, context: int, pin_bytes: int | None, history: UsageHistory | None,
              disk_bw: float, mem_bw: float) -> dict:
    """The budget split, expected bytes read per token, and floor times (seconds per token);
    `history`: the model's routing history (usage.UsageHistory), which chooses the hot-store's
    share, or None."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:  # 0: no state, as the engine splits
        raise ColibriError(f"--context must be a number of tokens (0 or more), got {context!r}")
    state = sizes.state_bytes_per_token * context
    fit = experts_fit(budget, sizes.dense_bytes, state, sizes.expert_nbytes)
    share = history.pin_share(fit, sizes.top_k) if history is not None and pin_bytes is None else 0.0
    split = split_budget(budget, sizes.dense_bytes, state, sizes.expert_nbytes, sizes.moe_layers,
                         sizes.n_experts, pin_bytes, share, sizes.top_k)
    resident_experts = min(sizes.experts_total, split.cache_slots * sizes.moe_layers + split.pinned_experts)
    resident_share = resident_experts / sizes.experts_total
    needed = sizes.moe_layers * sizes.top_k  # expert uses per token
    read_per_token = needed * (1 - resident_share) * sizes.expert_nbytes
    touched = sizes.dense_bytes + needed * sizes.expert_nbytes
    disk_floor = read_per_token / disk_bw if disk_bw else 0.0
    mem_floor = touched / mem_bw if mem_bw else 0.0
    return {
        "model": asdict(sizes),
        "experts_total": sizes.experts_total,
        "experts_bytes_total": sizes.experts_total * sizes.expert_nbytes,
        "context_tokens": context,
        "split": split.as_dict(),
        "resident_expert_share": resident_share,
        "expected_bytes_read_per_token": read_per_token,
        "bytes_touched_per_token": touched,
        "disk_bandwidth": disk_bw,
        "memory_bandwidth": mem_bw,
        "floor_seconds_per_token": {"disk": disk_floor, "memory": mem_floor, "floor": max(disk_floor, mem_floor)},
    }
