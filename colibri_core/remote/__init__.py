"""Routed experts served from other machines' RAM through Ray (`colibri run/serve --ray ADDRESS`).

    placement.py  which experts live on which node: by expert id or by layer range, sized to each
                  node's RAM from `ray.nodes()` (pure; `colibri plan --ray` prints it)
    shard.py      ShardServer: the body of one Ray actor, holding its experts in RAM read from its
                  own copy of the container, computing their slots with colibri's own kernels
    client.py     RemoteExperts: the driver's side, per MoE layer one call per shard carrying the
                  hidden states of the tokens routed there; timeouts, failure and rejoin

The driver keeps routing, attention, state and the local expert store, which stays a cache in
front of the shards; the expert source (colibri_core/experts.py) holds both: an expert resident
locally is computed locally, the others on their shard, and a shard that dies or misses its
deadline has its experts read from the local disk within the same call. Each (token, rank) slot
is computed independently by the same kernels wherever it runs and lands in the same slot, so
the output is bit-identical to a single machine's.

Ray is an optional extra (``pip install 'colibri[ray]'``): this package imports it only when asked.
"""
from __future__ import annotations

from ..errors import ColibriError

__all__ = ["require_ray", "connect", "RemoteExperts", "RAY_HINT"]

RAY_HINT = "pip install 'colibri[ray]'"


def require_ray():
    """The `ray` module, or a one-line ColibriError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ColibriError(f"--ray needs Ray, which is not installed: {RAY_HINT}") from None
    return ray


def connect(address: str):
    """Join the Ray cluster at `address` ("auto", "HOST:PORT" or "ray://HOST:PORT") once per process."""
    ray = require_ray()
    if not ray.is_initialized():
        _reachable(address)
        try:
            ray.init(address=address, log_to_driver=False, logging_level="WARNING", configure_logging=True)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise ColibriError(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0][:300]}") from None
    return ray


def __getattr__(name):
    if name == "RemoteExperts":
        from .client import RemoteExperts

        return RemoteExperts
    raise AttributeError(f"module 'colibri_core.remote' has no attribute {name!r}")


def _reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT that answers no TCP connection within `timeout` is one line now (Ray itself would
    retry for minutes, logging as it goes)."""
    import socket

    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ColibriError(f"--ray {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ColibriError(f"cannot join the Ray cluster at {address}: nothing answers there "
                           f"({e.strerror or e}); is `ray start --head` running?") from None


def cluster_nodes(address: str):
    """(ray, the driver's node id, the other alive nodes as placement.Node) of the cluster at `address`."""
    from .placement import nodes_from_ray

    ray = connect(address)
    me = ray.get_runtime_context().get_node_id()
    return ray, me, nodes_from_ray(ray.nodes(), exclude=me)
