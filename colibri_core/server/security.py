"""Who may talk to the server: the Host and Origin checks, CORS for allowed origins, and the API key.

Every request passes through `Guard`, an ASGI middleware in front of every route:

- **Host**: a browser that a web page has pointed at the server through its own domain name (DNS
  rebinding) sends that name as Host; only loopback names, IP literals, this machine's own names
  and the names of `--trusted-host` (a reverse proxy's public name; '*' any) are served, anything
  else is 403 naming `--trusted-host`.
- **Origin**: a browser says which page sent a request; one from a page other than the server's
  own (a foreign site, a sandboxed frame's "null") is 403 unless `--allow-origin` names it, and then
  it gets CORS headers (and preflights are answered). Requests without an Origin (curl, SDKs) pass.
  The two lists are apart: an allowed origin is a page elsewhere, which never makes its own name a
  Host this server answers to.
- **API key** (`--api-key`, `COLIBRI_API_KEY`): required on every endpoint but `/health`, as
  `Authorization: Bearer KEY`; the dashboard's pages (which a browser cannot send a header for) take
  a cookie set by its login form instead, holding a MAC of the key, never the key, and sent by the
  browser only to this site (SameSite=Strict, HttpOnly).
- **One of each**: a request with two Host, Origin or Authorization headers is a 400, since a proxy
  in front may have checked the one this server would not read.
"""
from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import json
import re
import socket
import urllib.parse

COOKIE = "colibri_key"
LOOPBACK_NAMES = ("localhost",)
PREFLIGHT_HEADERS = "Authorization, Content-Type"  # allowed when a preflight names none
SINGLE = ("host", "origin", "authorization")  # the headers the checks read: one of each, or none
HEADER_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")  # RFC 9110 tokens


def normalize_origin(origin: str) -> str:
    """'HTTP://Example.com:80/' → 'http://example.com'; ValueError if it is not an origin."""
    u = urllib.parse.urlsplit(origin.strip())
    if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/") or u.query or u.fragment:
        raise ValueError(f"{origin!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000)")
    port = u.port
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    default = {"http": 80, "https": 443}[u.scheme]
    return f"{u.scheme}://{host}" + (f":{port}" if port and port != default else "")


def split_host(host: str) -> tuple[str, str]:
    """'Example.com:8000' → ('example.com', '8000'); '[::1]:80' → ('::1', '80')."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest.lstrip(":")
    name, _, port = host.partition(":") if host.count(":") == 1 else (host, "", "")
    return name, port


HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?")


def is_host_name(host: str) -> bool:
    """Whether `host` is what a Host header names: a DNS name or an IP address (a :port allowed)."""
    name, port = split_host(host)
    return (port == "" or port.isdigit()) and (bool(HOST_NAME.fullmatch(name)) or _is_ip(name))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def dashboard_token(key: str) -> str:
    """What the dashboard's cookie holds: a MAC of the key (the key itself never leaves the form)."""
    return hmac.new(key.encode(), b"colibri dashboard v1", hashlib.sha256).hexdigest()


class Policy:
    """The checks, from the server's configuration."""

    def __init__(self, api_key: str | None, allow_origins=(), bound_host: str = "127.0.0.1", trusted_hosts=()):
        self.api_key = api_key
        self.any_origin = "*" in allow_origins
        self.origins = {normalize_origin(o) for o in allow_origins if o != "*"}
        self.any_host = "*" in trusted_hosts
        self.hosts = {*LOOPBACK_NAMES, *(split_host(h)[0] for h in trusted_hosts if h != "*")}
        bound = split_host(bound_host)[0]
        if bound and not _is_ip(bound):
            self.hosts.add(bound)
        if bound and (bound in ("0.0.0.0", "::") or not _is_ip(bound) or not ipaddress.ip_address(bound).is_loopback):
            name = socket.gethostname().lower()  # listening beyond loopback: this machine's own names too
            self.hosts |= {name, f"{name}.local", socket.getfqdn().lower()}
        self.token = dashboard_token(api_key) if api_key else None

    def host_ok(self, host: str | None) -> bool:
        if host is None or self.any_host:
            return True
        name = split_host(host)[0]
        return name in self.hosts or _is_ip(name)

    def origin_ok(self, origin: str, host: str | None) -> bool:
        """Same-origin (the server's own pages), or allowed by --allow-origin."""
        if self.any_origin:
            return True
        try:
            o = normalize_origin(origin)
        except ValueError:  # "null" (a sandboxed frame, a file), or garbage
            return False
        if o in self.origins:
            return True
        netloc = o.split("://", 1)[1]
        return host is not None and split_host(netloc) == _default_port(split_host(host), o)

    def cors_origin(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin to send: only to foreign origins allowed by name (or '*')."""
        if origin is None:
            return None
        if self.any_origin:
            return origin
        try:
            return origin if normalize_origin(origin) in self.origins else None
        except ValueError:
            return None

    def authorized(self, headers: dict[str, str]) -> bool:
        if not self.api_key:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key.encode()):
            return True
        cookie = _cookies(headers.get("cookie", "")).get(COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode("latin-1"), self.token.encode())


def _default_port(host: tuple[str, str], origin: str) -> tuple[str, str]:
    """The Host header's (name, port), its port spelled as the origin spells it (none for the default)."""
    name, port = host
    default = "443" if origin.startswith("https:") else "80"
    return name, "" if port == default else port


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        out.setdefault(name, value)
    return out


def error_body(status: int, message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>colibri: API key</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:16px system-ui,sans-serif;background:#0f1115;color:#e6e6e6;display:grid;place-items:center;height:100vh;margin:0}}
form{{background:#181b22;padding:2em;border-radius:10px;display:grid;gap:.8em;min-width:18em}}
input,button{{font:inherit;padding:.5em;border-radius:6px;border:1px solid #333;background:#0f1115;color:inherit}}
button{{background:#3b82f6;border:0;color:#fff;cursor:pointer}} .err{{color:#f87171}}</style></head>
<body><form method="post" action="/login"><strong>colibri</strong>
<label for="key">This server needs its API key.</label>
<input id="key" name="key" type="password" autocomplete="current-password" autofocus required>
{error}<button type="submit">Open the dashboard</button></form></body></html>
"""


def login_page(error: str = "") -> bytes:
    return LOGIN_PAGE.format(error=f'<div class="err">{html.escape(error)}</div>' if error else "").encode()


class Guard:
    """ASGI middleware: the Host, Origin and key checks in front of every route, CORS for allowed
    origins, and the dashboard's login form (`POST /login`)."""

    def __init__(self, app, policy: Policy, dashboard: bool):
        self.app, self.policy, self.dashboard = app, policy, dashboard

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        names = [k.decode("latin-1").lower() for k, _ in scope["headers"]]
        for name in SINGLE:
            if names.count(name) > 1:
                return await self._json(send, 400, f"the {name.title()} header is sent {names.count(name)} times; "
                                        f"send it once", "duplicate_header")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        host, origin = headers.get("host"), headers.get("origin")
        p = self.policy
        if not p.host_ok(host):
            return await self._json(send, 403, f"requests for host {host!r} are refused (a web page may be using its own "
                                    f"domain name to reach this server); start colibri with --trusted-host "
                                    f"{split_host(host)[0]} to serve it (behind a reverse proxy: its public name)",
                                    "forbidden_host")
        if origin is not None and not p.origin_ok(origin, host):
            return await self._json(send, 403, f"requests from the web page {origin!r} are refused; start colibri "
                                    f"with --allow-origin {origin} to allow it", "forbidden_origin")
        cors = p.cors_origin(origin)
        if method == "OPTIONS" and cors and "access-control-request-method" in headers:  # a CORS preflight
            # the headers the page asks for, whatever they are (the OpenAI SDKs send x-stainless-*): the
            # origin is allowed by name, and the key check still applies to the request itself
            asked = headers.get("access-control-request-headers", "").strip()
            allow = asked if HEADER_LIST.fullmatch(asked) else PREFLIGHT_HEADERS
            return await self._send(send, 204, b"", [(b"content-type", b"text/plain")], cors, allow)
        if path == "/health":
            return await self.app(scope, receive, self._with_cors(send, cors))
        if self.dashboard and path == "/login" and method == "POST":
            return await self._login(receive, send)
        if not p.authorized(headers):
            if self.dashboard and path == "/" and method == "GET":  # a browser opening the dashboard
                return await self._send(send, 401, login_page(), [(b"content-type", b"text/html; charset=utf-8")], cors)
            return await self._json(send, 401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                                    "invalid_api_key", cors, [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, self._with_cors(send, cors))

    def _with_cors(self, send, cors: str | None):
        if cors is None:
            return send

        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_cors_headers(cors)]}
            await send(message)
        return sending

    async def _json(self, send, status, message, code, cors=None, extra=()):
        await self._send(send, status, error_body(status, message, code),
                         [(b"content-type", b"application/json"), *extra], cors)

    async def _send(self, send, status, body, headers, cors=None, allow_headers=PREFLIGHT_HEADERS):
        headers = [*headers, (b"content-length", str(len(body)).encode())]
        if cors:
            headers += _cors_headers(cors, allow_headers)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _login(self, receive, send):
        """The dashboard's login form: the right key sets the cookie and goes to the dashboard."""
        body, more = b"", True
        while more and len(body) <= 8192:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        key = urllib.parse.parse_qs(body[:8192].decode("utf-8", "replace")).get("key", [""])[0]
        p = self.policy
        if not p.api_key or not hmac.compare_digest(key.encode("utf-8", "replace"), p.api_key.encode()):
            return await self._send(send, 401, login_page("That is not this server's key."),
                                    [(b"content-type", b"text/html; charset=utf-8")])
        cookie = f"{COOKIE}={p.token}; Path=/; HttpOnly; SameSite=Strict".encode()
        await self._send(send, 303, b"", [(b"location", b"/"), (b"set-cookie", cookie)])


def _cors_headers(origin: str, allow_headers: str = PREFLIGHT_HEADERS) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-allow-headers", allow_headers.encode("latin-1")),
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"), (b"access-control-max-age", b"600"),
            (b"access-control-expose-headers", b"Retry-After")]
