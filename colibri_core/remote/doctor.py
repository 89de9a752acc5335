"""`colibri doctor --ray ADDRESS`: the cluster's checks, one (name, PASS/WARN/FAIL, detail) each.

Ray installed; the cluster reachable; its alive nodes besides this one and their RAM; the placement
the engine would make; on every node, a task (bounded by a timeout) that opens the model there and
compares its experts with the local container's (`shard.identity`).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ColibriError

NODE_TIMEOUT = 60.0  # seconds a node has to open its copy of the model


def _open_there(path: str) -> dict:
    import ray

    from ..container import Container
    from ..kernels import simd
    from .shard import identity

    try:
        c = Container(path)
    except ColibriError as e:
        return {"error": str(e)}
    out = {"identity": identity(c), "simd": simd(), "node": ray.get_runtime_context().get_node_id()}
    c.close()
    return out


def ray_checks(address: str, model_dir: str | Path, paths: dict, default: str | None) -> list[tuple[str, str, str]]:
    from ..sizes import format_bytes

    out = []
    try:
        from . import cluster_nodes, require_ray

        ray = require_ray()
        out.append(("ray", "PASS", f"Ray {ray.__version__} installed"))
        ray, me, nodes = cluster_nodes(address)
    except ColibriError as e:
        return out + [("ray cluster", "FAIL", str(e))]
    total = sum(n.memory for n in nodes)
    out.append(("ray cluster", "PASS" if nodes else "FAIL",
                f"{address}: {len(nodes)} alive nodes besides this one, {format_bytes(total)} of Ray memory"
                if nodes else f"{address}: no alive node besides this one to hold experts"))
    try:
        from ..container import Container
        from .placement import cluster_plan
        from .shard import identity

        c = Container(model_dir)
        mine = identity(c)
        plan = cluster_plan(nodes, c.moe_layers, c.n_experts, c.expert_nbytes, 1)
        c.close()
    except ColibriError as e:
        return out + [("ray model", "FAIL", f"the local model cannot be opened: {e}")]
    out.append(("ray placement", "PASS" if plan["experts_local"] == 0 else "WARN",
                f"{plan['experts_remote']} experts fit on the cluster, {plan['experts_local']} stay on the local disk"))
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_open_there)
    for n in nodes:
        path = paths.get(n.id) or paths.get(n.address) or default or str(model_dir)
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.id, soft=False)).remote(path)
        name = f"ray node {n.address} ({n.id[:8]})"
        try:
            got = ray.get(ref, timeout=NODE_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            out.append((name, "FAIL", f"did not open {path} within {NODE_TIMEOUT:g} s"))
            continue
        except ray.exceptions.RayError as e:
            out.append((name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        if "error" in got:
            out.append((name, "FAIL", got["error"]))
        elif got["identity"] != mine:
            out.append((name, "FAIL", f"{path} there holds another model or conversion than {model_dir}"))
        else:
            out.append((name, "PASS", f"{path} opens, same experts as here; {format_bytes(n.memory)} of Ray memory; "
                                      f"SIMD {got['simd']}"))
    return out
