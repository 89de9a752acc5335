"""Who may talk to the server: the Host and Origin checks, CORS for allowed origins, and the API key.

Every request passes through `Guard`, a chain of ASGI middlewares in front of every route:

- **One of each**: a request with two Host, Origin or Authorization headers is a 400, since a proxy
  in front may have checked the one this server would not read.
- **Host** (Starlette's `TrustedHostMiddleware`): a browser that a web page has pointed at the
  server through its own domain name (DNS rebinding) sends that name as Host; only loopback names,
  IP literals, this machine's own names and the names of `--trusted-host` (a reverse proxy's public
  name; '*' any) are served, anything else is 403 naming `--trusted-host`.
- **Origin**: a browser says which page sent a request; one from a page other than the server's
  own (a foreign site, a sandboxed frame's "null") is 403 unless `--allow-origin` names it. Starlette
  has no such check (its CORS middleware only decides which responses a page may read, and a
  "simple" text/plain POST runs whatever it answers), so it is written here. Requests without an
  Origin (curl, SDKs) pass. The two lists are apart: an allowed origin is a page elsewhere, which
  never makes its own name a Host this server answers to.
- **CORS** (Starlette's `CORSMiddleware`): pages of `--allow-origin` get CORS headers, and their
  preflights are answered.
- **API key** (`--api-key`, `COLIBRI_API_KEY`): required on every endpoint but `/health`, as
  `Authorization: Bearer KEY`; the dashboard's pages (which a browser cannot send a header for) take
  a cookie set by its login form instead, holding a MAC of the key, never the key, and sent by the
  browser only to this site (SameSite=Strict, HttpOnly).

Every refusal is a JSON body of the OpenAI error form naming what to change.
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

from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

COOKIE = "colibri_key"
LOOPBACK_NAMES = ("localhost",)
PREFLIGHT_HEADERS = "Authorization, Content-Type"  # allowed when a preflight's list is not one
SINGLE = ("host", "origin", "authorization")  # the headers the checks read: one of each, or none
HEADER_LIST = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*")  # RFC 9110 tokens
LOGIN_BYTES = 8192  # the most of a login form read


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

    def authorized(self, request: Request) -> bool:
        if not self.api_key:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"), self.api_key.encode()):
            return True
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and hmac.compare_digest(cookie.encode("utf-8", "replace"), self.token.encode())


def _default_port(host: tuple[str, str], origin: str) -> tuple[str, str]:
    """The Host header's (name, port), its port spelled as the origin spells it (none for the default)."""
    name, port = host
    default = "443" if origin.startswith("https:") else "80"
    return name, "" if port == default else port


def error(status: int, message: str, code: str, headers=None) -> Response:
    """A refusal in the OpenAI error form."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return Response(json.dumps(body), status, headers, media_type="application/json")


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


def login_page(problem: str = "") -> str:
    return LOGIN_PAGE.format(error=f'<div class="err">{html.escape(problem)}</div>' if problem else "")


class Guard:
    """ASGI middleware: the checks above in front of every route (outermost first), and the
    dashboard's login form (`POST /login`)."""

    def __init__(self, app, policy: Policy, dashboard: bool):
        self.app = app
        self.checks = TrustedHosts(OriginCheck(CORS(KeyCheck(app, policy, dashboard), policy), policy), policy)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # the lifespan
            return await self.app(scope, receive, send)
        names = [k.decode("latin-1").lower() for k, _ in scope["headers"]]
        for name in SINGLE:
            if names.count(name) > 1:
                response = error(400, f"the {name.title()} header is sent {names.count(name)} times; send it once",
                                 "duplicate_header")
                return await response(scope, receive, send)
        await self.checks(scope, receive, send)


class TrustedHosts(TrustedHostMiddleware):
    """Starlette's Host allow-list (`Policy.hosts`, or '*'), IP literals besides (rebinding needs a
    name, and requests without a Host have none), its refusal the project's 403 naming --trusted-host."""

    def __init__(self, app, policy: Policy):
        super().__init__(self._trusted, allowed_hosts=["*"] if policy.any_host else sorted(policy.hosts),
                         www_redirect=False)
        self.next = app

    async def __call__(self, scope, receive, send):
        host = Headers(scope=scope).get("host")
        if host is None or _is_ip(split_host(host)[0]):
            return await self.next(scope, receive, send)
        await super().__call__(scope, receive, _Refusal(scope, receive, send, host))

    async def _trusted(self, scope, receive, send: _Refusal):
        await self.next(scope, receive, send.send)  # what the route answers goes out as it is


class _Refusal:
    """The `send` TrustedHostMiddleware gets: it answers only a refused Host through it (a trusted
    one reaches `_trusted`, which sends past it), and its plain-text 400 goes out as this 403."""

    def __init__(self, scope, receive, send, host: str):
        self.scope, self.receive, self.send, self.host = scope, receive, send, host

    async def __call__(self, message):
        if message["type"] == "http.response.start":
            response = error(403, f"requests for host {self.host!r} are refused (a web page may be using its own "
                             f"domain name to reach this server); start colibri with --trusted-host "
                             f"{split_host(self.host)[0]} to serve it (behind a reverse proxy: its public name)",
                             "forbidden_host")
            await response(self.scope, self.receive, self.send)


class OriginCheck:
    """A browser's request from a page that is neither the server's own nor of --allow-origin: 403."""

    def __init__(self, app, policy: Policy):
        self.app, self.policy = app, policy

    async def __call__(self, scope, receive, send):
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_ok(origin, headers.get("host")):
            response = error(403, f"requests from the web page {origin!r} are refused; start colibri with "
                             f"--allow-origin {origin} to allow it", "forbidden_origin")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class CORS(CORSMiddleware):
    """Starlette's CORS for the pages of --allow-origin. A preflight may ask for any headers (the
    OpenAI SDKs send x-stainless-*): the origin is allowed by name, and the key check still applies
    to the request itself; a list that is no list of header names is not echoed back."""

    def __init__(self, app, policy: Policy):
        super().__init__(app, allow_origins=["*"] if policy.any_origin else sorted(policy.origins),
                         allow_methods=("GET", "POST", "OPTIONS"), allow_headers=("*",), expose_headers=("Retry-After",))

    def preflight_response(self, request_headers: Headers) -> Response:
        asked = request_headers.get("access-control-request-headers")
        if asked is not None and not HEADER_LIST.fullmatch(asked.strip()):
            request_headers = MutableHeaders(raw=list(request_headers.raw))
            request_headers["access-control-request-headers"] = PREFLIGHT_HEADERS
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        return error(400, f"{response.body.decode()} (a method other than GET, POST or OPTIONS, or private network "
                     "access)", "cors_refused", headers)


class KeyCheck:
    """The API key on every route but /health: a Bearer header, or the dashboard's cookie, set by its
    login form (`POST /login`); a browser opening the dashboard without either gets the form."""

    def __init__(self, app, policy: Policy, dashboard: bool):
        self.app, self.policy, self.dashboard = app, policy, dashboard

    async def __call__(self, scope, receive, send):
        if scope["path"] == "/health":
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        if self.dashboard and scope["path"] == "/login" and scope["method"] == "POST":
            response = await self._login(request)
            return await response(scope, receive, send)
        if self.policy.authorized(request):
            return await self.app(scope, receive, send)
        if self.dashboard and scope["path"] == "/" and scope["method"] == "GET":  # a browser opening the dashboard
            response = HTMLResponse(login_page(), 401)
        else:
            response = error(401, "invalid or missing API key: send 'Authorization: Bearer KEY'", "invalid_api_key",
                             {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    async def _login(self, request: Request) -> Response:
        """The dashboard's login form: the right key sets the cookie and goes to the dashboard."""
        body = b""
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > LOGIN_BYTES:
                    break
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is left to read it
        key = urllib.parse.parse_qs(body[:LOGIN_BYTES].decode("utf-8", "replace")).get("key", [""])[0]
        p = self.policy
        if not p.api_key or not hmac.compare_digest(key.encode("utf-8", "replace"), p.api_key.encode()):
            return HTMLResponse(login_page("That is not this server's key."), 401)
        response = RedirectResponse("/", 303)
        response.set_cookie(COOKIE, p.token, path="/", httponly=True, samesite="Strict")
        return response
