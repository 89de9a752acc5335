"""Who may use the server: the API key on every endpoint but /health (with and without it, each
endpoint), the dashboard's login, an empty key refused, the Host and Origin checks (DNS rebinding,
a foreign web page's text/plain POST), --allow-origin and CORS, static files only from the package's
own directory (path traversal), no request reading or writing a path of the caller's choosing, and
no response disclosing where the model lives.
"""
import asyncio
import http.client
import json
import mimetypes
import socket
import sys
import threading
import time
import urllib.parse

import pytest

from colibri_core.server import ServerConfig, bind, create_app
from colibri_core.server.app import STATIC
from colibri_core.server.security import Guard, Policy
from conftest import colibri
from live_server import LiveServer, get, post

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# every route of the app: (method, path, body), what it answers with the key
ENDPOINTS = [
    ("GET", "/health", None, 200),
    ("GET", "/v1/models", None, 200),
    ("GET", "/v1/models/{model}", None, 200),
    ("POST", "/v1/chat/completions", CHAT, 200),
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}, 200),
    ("POST", "/v1/embeddings", {"input": "a"}, 200),
    ("POST", "/tokenize", {"content": "a"}, 200),
    ("POST", "/detokenize", {"tokens": [5]}, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/api/stats", None, 200),
    ("GET", "/api/brain", None, 200),
    ("GET", "/api/atlas", None, 404),  # until `colibri atlas` has characterised the model
    ("GET", "/openapi.json", None, 200),
    ("GET", "/", None, 200),
    ("GET", "/atlas", None, 200),  # `colibri web` only, as the two below
    ("GET", "/static/app.js", None, 200),  # `colibri web` only
    ("GET", "/static/style.css", None, 200),
    ("POST", "/login", None, None),  # the login form: open by nature (tested below)
    ("GET", "/no/such/endpoint", None, 404),
]


def test_every_route_is_in_the_table(tiny_model):
    paths = {p for _, p, _, _ in ENDPOINTS}
    for dashboard in (False, True):
        app = create_app(ServerConfig(tiny_model, dashboard=dashboard))
        for route in app.routes:
            path = route.path.replace("{model:path}", "{model}")
            assert path in paths or (path == "/static" and "/static/app.js" in paths), path


def request(url, method, path, body=None, headers=None):
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def web_with_key(tiny_model):
    s = LiveServer("web", tiny_model, "--api-key", KEY, "--model-name", "tiny")
    yield s
    s.stop()
    assert "Traceback" not in s.text_log(), s.text_log()


@pytest.mark.parametrize("method,path,body,want", [e for e in ENDPOINTS if e[1] != "/login"],
                         ids=[e[1] for e in ENDPOINTS if e[1] != "/login"])
def test_every_endpoint_with_and_without_the_key(web_with_key, method, path, body, want):
    path = path.replace("{model}", "tiny")
    status, headers, raw = request(web_with_key.url, method, path, body)
    if path == "/health":
        assert status == 200  # the one open endpoint: a load balancer's probe needs no key
    else:
        assert status == 401, (status, raw[:200])
        if path == "/":  # a browser opening the dashboard gets the login form, and nothing of the page
            assert b'action="/login"' in raw and b"app.js" not in raw
        else:
            assert json.loads(raw)["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
    assert request(web_with_key.url, method, path, body, {"Authorization": "Bearer wrong"})[0] == (200 if path == "/health" else 401)
    status, _, raw = request(web_with_key.url, method, path, body, AUTH)
    assert status == want, (status, raw[:300])


def test_dashboard_login_sets_a_cookie_that_is_not_the_key(web_with_key):
    url = web_with_key.url
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, raw = request(url, "POST", "/login", b"key=wrong", form)
    assert status == 401 and b"not this server" in raw
    status, headers, _ = request(url, "POST", "/login", f"key={KEY}".encode(), form)
    assert status == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEY not in cookie
    jar = {"Cookie": cookie.split(";")[0]}
    for path in ("/", "/static/app.js", "/api/stats", "/api/brain", "/metrics"):
        assert request(url, "GET", path, None, jar)[0] == 200, path
    assert request(url, "POST", "/v1/chat/completions", CHAT, jar)[0] == 200
    assert request(url, "GET", "/", None, {"Cookie": "colibri_key=0123"})[0] == 401
    # the cookie does not make a foreign page's request acceptable
    status, _, raw = request(url, "POST", "/v1/chat/completions", CHAT, {**jar, "Origin": "http://evil.example"})
    assert status == 403 and json.loads(raw)["error"]["code"] == "forbidden_origin"


@pytest.mark.parametrize("how", ["--api-key", "env", "blank"])
def test_an_empty_key_is_an_error(tiny_model, how):
    import os

    env = {**os.environ}
    args = ["serve", "--model", tiny_model, "--port", "0"]
    if how == "--api-key":
        args += ["--api-key", ""]
    elif how == "env":
        env["COLIBRI_API_KEY"] = ""  # e.g. COLIBRI_API_KEY=$KEY with KEY unset
    else:
        args += ["--api-key", "   "]
    r = colibri(*args, env=env, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "API key is empty" in lines[0], r.stderr


# ---- Host and Origin ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def open_server(tiny_model):
    s = LiveServer("web", tiny_model, "--model-name", "tiny")
    yield s
    s.stop()


def test_foreign_host_and_origin_are_refused(open_server):
    url = open_server.url
    port = urllib.parse.urlsplit(url).port
    # DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1
    for path, method, body in (("/health", "GET", None), ("/v1/completions", "POST", {"prompt": "a", "max_tokens": 1})):
        status, _, raw = request(url, method, path, body, {"Host": f"evil.example:{port}",
                                                            "Origin": f"http://evil.example:{port}"})
        assert status == 403 and json.loads(raw)["error"]["code"] == "forbidden_host", raw
    # any web page the user visits: a "simple" text/plain POST that needs no preflight
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{port + 1}", "https://localhost"):
        status, _, raw = request(url, "POST", "/v1/completions", b'{"prompt": "a", "max_tokens": 1}',
                                 {"Origin": origin, "Content-Type": "text/plain"})
        assert status == 403 and json.loads(raw)["error"]["code"] == "forbidden_origin", (origin, raw)
    # the server's own pages, loopback names and clients that send no Origin are served
    for headers in ({}, {"Origin": url}, {"Host": f"localhost:{port}"}, {"Host": f"[::1]:{port}"},
                    {"Host": "127.0.0.1"}, {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}):
        status, resp_headers, _ = request(url, "POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}, headers)
        assert status == 200, headers
        assert "access-control-allow-origin" not in resp_headers  # no CORS for anyone by default


def raw_request(url: str, head: str) -> tuple[int, bytes]:
    """A request whose header lines are sent exactly as written (http.client sends a header once)."""
    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(f"{head}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.parametrize("twice", [
    f"Authorization: Bearer {KEY}\r\nAuthorization: Bearer wrong\r\n",
    f"Authorization: Bearer wrong\r\nAuthorization: Bearer {KEY}\r\n",
    f"Authorization: Bearer {KEY}\r\nOrigin: http://127.0.0.1\r\norigin: http://evil.example\r\n",
], ids=["authorization", "authorization-last-right", "origin"])
def test_a_header_the_checks_read_sent_twice_is_refused(web_with_key, twice):
    """Whichever copy the server read (the last), a proxy in front may have checked the other one.
    (Two Host headers never reach the app here: uvicorn's HTTP parser refuses them; the guard's own
    check, for servers that pass them on, is tested below.)"""
    for path in ("/v1/models", "/health"):
        status, body = raw_request(web_with_key.url, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{twice}")
        error = json.loads(body)["error"]
        assert status == 400 and error["code"] == "duplicate_header", body
        assert error["type"] == "invalid_request_error" and "header is sent 2 times" in error["message"]
    once = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
    assert raw_request(web_with_key.url, once)[0] == 200


@pytest.mark.parametrize("name", ["Host", "Origin", "Authorization"])
def test_the_guard_refuses_two_of_a_header_it_reads(name):
    """The guard as an ASGI app, given what an HTTP server that keeps duplicate headers passes on."""
    async def app(scope, receive, send):
        raise AssertionError("the request went past the guard")

    sent = []

    async def send(message):
        sent.append(message)

    headers = [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {KEY}".encode()), (b"origin", b"http://127.0.0.1")]
    headers.append((name.lower().encode(), b"evil.example" if name == "Host" else b"http://evil.example"))
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}
    asyncio.run(Guard(app, Policy(KEY), dashboard=False)(scope, None, send))
    error = json.loads(sent[1]["body"])["error"]
    assert sent[0]["status"] == 400 and error == {"message": f"the {name} header is sent 2 times; send it once",
                                                  "type": "invalid_request_error", "param": None,
                                                  "code": "duplicate_header"}


def test_allow_origin_opens_cors_for_that_origin_only(tiny_model):
    app_origin = "http://app.example:3000"
    s = LiveServer("serve", tiny_model, "--allow-origin", app_origin, "--api-key", KEY)
    try:
        status, headers, _ = request(s.url, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": app_origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 200 and headers["access-control-allow-origin"] == app_origin  # any 2xx is a preflight's "ok"
        assert "authorization" in headers["access-control-allow-headers"].lower()
        # a method the API has no use for is refused, in the API's error form
        status, _, raw = request(s.url, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": app_origin, "Access-Control-Request-Method": "DELETE"})
        assert status == 400 and json.loads(raw)["error"]["code"] == "cors_refused", raw
        # the OpenAI SDKs' own headers: a preflight that refused them would stop every request from the page
        sdk = "authorization,content-type,x-stainless-os,x-stainless-lang,x-stainless-retry-count,x-stainless-timeout"
        status, headers, _ = request(s.url, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": app_origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": sdk})
        allowed = {h.strip().lower() for h in headers["access-control-allow-headers"].split(",")}
        assert status == 200 and allowed >= set(sdk.split(",")), headers
        # a header list that is not one (CR/LF, quotes) is never echoed
        status, headers, _ = request(s.url, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": app_origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": 'x-a, "b"'})
        assert status == 200 and headers["access-control-allow-headers"] == "Authorization, Content-Type"
        status, headers, _ = request(s.url, "POST", "/v1/chat/completions", CHAT, {"Origin": app_origin, **AUTH})
        assert status == 200 and headers["access-control-allow-origin"] == app_origin
        status, headers, _ = request(s.url, "POST", "/v1/chat/completions", CHAT, {"Origin": app_origin})
        assert status == 401 and headers["access-control-allow-origin"] == app_origin  # the page may read why
        # an allowed origin is a page elsewhere, not a Host this server answers to (--trusted-host is)
        assert request(s.url, "GET", "/v1/models", None, {"Host": "app.example:3000", **AUTH})[0] == 403
        status, headers, _ = request(s.url, "POST", "/v1/chat/completions", CHAT, {"Origin": "http://other.example", **AUTH})
        assert status == 403 and "access-control-allow-origin" not in headers
    finally:
        s.stop()
    r = colibri("serve", "--model", tiny_model, "--allow-origin", "app.example/path", timeout=60)
    assert r.returncode == 1 and "--allow-origin" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- files --------------------------------------------------------------------------------------------
TRAVERSALS = ["/static/../app.py", "/static/..%2fapp.py", "/static/%2e%2e/%2e%2e/server/app.py",
              "/static/%2e%2e%2f__init__.py", "/static//etc/passwd", "/static/%2fetc%2fpasswd",
              "/static/..%5capp.py", "/static/....//app.py", "/static/app.js%00.py", "/static/../../../../../etc/passwd",
              "/../../etc/passwd", "/static/%252e%252e/app.py", "/static/.%2e/app.py", "/static/"]


def raw_get(url: str, target: str) -> tuple[int, bytes]:
    """GET with the request target sent exactly as written (no client-side normalisation)."""
    return raw_request(url, f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n")


@pytest.mark.parametrize("target", TRAVERSALS)
def test_static_files_only_from_the_package(open_server, target):
    status, body = raw_get(open_server.url, target)
    assert status in (400, 404), (status, body[:200])
    assert b"import " not in body and b"root:" not in body


def test_static_files_are_served(open_server):
    assert raw_get(open_server.url, "/static/app.js")[1] == (STATIC / "app.js").read_bytes()


def test_no_response_discloses_the_model_path(web_with_key, tiny_model):
    secret = [str(tiny_model.resolve()).encode(), str(tiny_model.resolve().parent).encode()]
    for method, path, body, _ in ENDPOINTS:
        if path == "/login":
            continue
        raw = request(web_with_key.url, method, path.replace("{model}", "tiny"), body, AUTH)[2]
        assert not any(s in raw for s in secret), path
    status, _, raw = request(web_with_key.url, "POST", "/v1/completions", {"model": str(tiny_model.resolve()),
                                                                           "prompt": "a"}, AUTH)
    assert status == 404  # the model is asked for by id: a path is never confirmed


def test_no_request_reads_or_writes_a_path_of_the_callers_choosing(tiny_model, tmp_path):
    """An audit hook watches every file the server process opens, creates, renames or removes while
    requests carrying a sentinel file's path (absolute, relative, traversing) in every field arrive."""
    import uvicorn

    sentinel_dir = tmp_path / "sentinel"
    sentinel_dir.mkdir()
    (sentinel_dir / "secret.txt").write_text("secret")
    events: list = []
    watching = threading.Event()

    def hook(event, args):
        if watching.is_set() and event in ("open", "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink",
                                           "os.truncate", "shutil.copyfile", "shutil.rmtree", "os.listdir", "os.scandir"):
            events.append((event, str(args[0]) if args else ""))

    sys.addaudithook(hook)  # cannot be removed: it records only while `watching` is set
    sock = bind("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(ServerConfig(tiny_model, dashboard=True, model_name="tiny")),
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while get(url + "/health")[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rel = "../" * 12 + str(sentinel_dir / "secret.txt").lstrip("/")
        paths = [str(sentinel_dir / "secret.txt"), rel, "file://" + str(sentinel_dir / "secret.txt"), str(sentinel_dir)]
        watching.set()
        for p in paths:
            q = urllib.parse.quote(p, safe="")
            bodies = [
                ("/v1/chat/completions", {"model": p, "messages": [{"role": "user", "content": p, "name": p}]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": p}}]}],
                                          "max_tokens": 1}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "tools": [{"type": "function",
                                          "function": {"name": p}}], "max_tokens": 1, "stop": [p], "user": p}),
                ("/v1/completions", {"prompt": p, "max_tokens": 1, "suffix": p, "user": p}),
                ("/v1/completions", {"model": p, "prompt": p}),
                ("/tokenize", {"content": p, "model": p}), ("/tokenize", {"prompt": p}),
                ("/tokenize", {"messages": [{"role": "user", "content": p}]}),
                ("/detokenize", {"tokens": [1], "model": p}),
            ]
            for path, body in bodies:
                assert post(url + path, body)[0] in (200, 400, 404)
            for path in (f"/v1/models/{q}", f"/static/{q}", f"/api/stats?since={q}", f"/api/brain?since={q}",
                         f"/{q}", f"/metrics?path={q}"):
                assert get(url + path)[0] in (200, 400, 404)
        assert get(url + "/static/app.js")[0] == 200  # a file the server does open: the hook sees it
        watching.clear()
    finally:
        watching.clear()
        uv.should_exit = True
        thread.join(30)
    assert ("open", str(STATIC / "app.js")) in events, events[:20]
    touched = [(e, p) for e, p in events if "sentinel" in p or "secret" in p]
    assert not touched, touched
    model_dir, static = str(tiny_model.resolve()), str(STATIC)
    fixed = set(mimetypes.knownfiles)  # the system's MIME table, read once when a file is first served
    outside = {(e, p) for e, p in events if p and p not in fixed
               and not p.startswith((model_dir, static, sys.prefix, sys.base_prefix, "/proc/", "/sys/", "/dev/"))
               and not p.isdigit() and not p.endswith((".py", ".pyc", ".so"))}
    assert not outside, outside


def test_listening_beyond_loopback_without_a_key_warns(tiny_model):
    """`--host 0.0.0.0`: a warning that anyone who reaches the port can use the model; the machine's
    own name is a Host it answers to, other names are still refused."""
    s = LiveServer("serve", tiny_model, "--host", "0.0.0.0")
    try:
        assert "without --api-key" in s.text_log()
        name = socket.gethostname()
        port = urllib.parse.urlsplit(s.url).port
        assert request(s.url, "GET", "/v1/models", None, {"Host": f"{name}:{port}"})[0] == 200
        assert request(s.url, "GET", "/v1/models", None, {"Host": f"evil.example:{port}"})[0] == 403
    finally:
        s.stop()
    s = LiveServer("serve", tiny_model, "--api-key", KEY)  # loopback, with a key: nothing to warn about
    try:
        assert "warning" not in s.text_log()
    finally:
        s.stop()
