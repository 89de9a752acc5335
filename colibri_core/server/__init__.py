"""`colibri serve` and `colibri web`: the OpenAI-compatible HTTP API (and the dashboard) on uvicorn.

    from colibri_core.options import EngineOptions
    from colibri_core.server import ServerConfig, serve
    serve(ServerConfig(model_dir="models/olmoe", engine=EngineOptions(ram="4GB")), host="127.0.0.1", port=8000)

See `app.py` for the endpoints, `worker.py` for the queue (and the one thread that runs the engine),
`snapshot.py` for what the endpoints read of the engine, `static/` for the dashboard.
"""
from __future__ import annotations

import copy
import dataclasses
import ipaddress
import logging
import signal
import socket
import sys

from ..errors import ColibriError
from . import memory
from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app", "serve"]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port), or a one-line ColibriError."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ColibriError(f"cannot resolve host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ColibriError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _quiet_polls(record: logging.LogRecord) -> bool:
    """Access-log filter: leave out the dashboard's own polling (/api/…) when it succeeds."""
    args = record.args  # (client, method, path, http version, status)
    return not (isinstance(args, tuple) and len(args) == 5 and str(args[2]).startswith("/api/") and args[4] < 400)


def header_timeout_protocol(seconds: float):
    """uvicorn's HTTP/1.1 protocol, but a connection whose request headers have not arrived whole
    `seconds` after it opened (or after its last answer) is closed: half-sent requests cannot hold
    connections (and file descriptors) for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def _arm(self):
            self.loop.call_later(seconds, self._expire, self.cycle)

        def _expire(self, cycle):
            # no request has begun since the timer was armed, and none is being answered
            if self.cycle is cycle and (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeout


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def serve(cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000, access_log: bool = True) -> None:
    """Listen, load the model in the background, serve until interrupted. A model that fails to
    load stops the server and raises ColibriError with the reason."""
    import uvicorn

    from .. import plugins
    from ..convert import read_config

    # the cheap checks first, so a wrong directory is one line before anything listens
    plugins.registry().resolve(read_config(cfg.model_dir), where=str(cfg.model_dir))
    cfg = dataclasses.replace(cfg, host=host)
    memory.return_large_buffers()
    sock = bind(host, port)
    if not _loopback(host) and not cfg.api_key:
        print(f"colibri: warning: listening on {host} without --api-key: anyone who can reach this port can use "
              "the model", file=sys.stderr, flush=True)
    app = create_app(cfg)
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["loggers"]["uvicorn.error"]["level"] = "WARNING"  # our own lines say where and when; keep access logs
    logs["loggers"]["uvicorn.access"]["level"] = "INFO" if access_log else "WARNING"
    server = uvicorn.Server(uvicorn.Config(app, log_level=None, log_config=logs, timeout_graceful_shutdown=3,
                                           http=header_timeout_protocol(cfg.header_timeout)))
    logging.getLogger("uvicorn.access").addFilter(_quiet_polls)
    state = app.state.server

    def loaded(s):
        if s.load_error:
            server.should_exit = True
        else:
            print(f"colibri: model {s.model_id} loaded; ready", file=sys.stderr, flush=True)

    state.on_loaded = loaded
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
    print(f"colibri: serving {state.model_id} on {url}" + (f" (dashboard: {url}/)" if cfg.dashboard else "")
          + f"; loading {cfg.model_dir}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if state.load_error:
        raise ColibriError(state.load_error)
    # uvicorn raises the signal that stopped it again once it has shut down, so Ctrl-C exits 130.
    # After one 1-hour soak that was lost (exit 0; never reproduced): Ctrl-C exits 130 regardless,
    # and a stop that no signal asked for says so.
    if signal.SIGINT in getattr(server, "_captured_signals", ()):
        raise KeyboardInterrupt
    print("colibri: the server stopped without a signal or an error", file=sys.stderr, flush=True)
