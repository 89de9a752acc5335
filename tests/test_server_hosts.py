"""Behind a reverse proxy: --trusted-host names the Host values the server answers to, apart from
--allow-origin's CORS origins, and each 403 names the option that lifts it (the Host check told the
user to pass --allow-origin). The guard is called as the ASGI app it is: no server, no model."""
import asyncio
import json

import pytest

from colibri_core.errors import ColibriError
from colibri_core.server import ServerConfig
from colibri_core.server.security import Guard, Policy
from conftest import colibri
from test_cli import one_line_error


def ask(policy: Policy, host: str, origin: str | None = None) -> tuple[int, dict]:
    """The status and JSON body (None when the request went through) of a GET /v1/models."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent = []

    async def send(message):
        sent.append(message)

    headers = [(b"host", host.encode())] + ([(b"origin", origin.encode())] if origin else [])
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}
    asyncio.run(Guard(app, policy, dashboard=False)(scope, None, send))
    body = sent[1]["body"]
    return sent[0]["status"], json.loads(body)["error"] if body else None


def test_a_proxys_public_name_is_served_with_trusted_host():
    """A proxy passing on Host: llm.example.com (its public name), and the pages it serves (same origin)."""
    status, error = ask(Policy(None), "llm.example.com")
    assert status == 403 and error["code"] == "forbidden_host"
    assert "start colibri with --trusted-host llm.example.com to serve it" in error["message"]
    assert "--allow-origin" not in error["message"]
    trusted = Policy(None, trusted_hosts=("llm.example.com",))
    assert ask(trusted, "llm.example.com")[0] == 200
    assert ask(trusted, "LLM.example.com:443", "https://llm.example.com:443")[0] == 200  # its own page
    assert ask(trusted, "other.example.com")[0] == 403
    assert ask(Policy(None, trusted_hosts=("*",)), "anything.example")[0] == 200


def test_trusted_hosts_and_allowed_origins_are_apart():
    """An allowed origin is a page elsewhere: it gets CORS, never its name as a Host (and '*' origins
    are not '*' hosts); a trusted host's foreign page still needs --allow-origin, which the 403 names."""
    cors = Policy(None, allow_origins=("http://app.example:3000",))
    assert ask(cors, "app.example:3000")[0] == 403
    assert ask(Policy(None, allow_origins=("*",)), "evil.example")[0] == 403
    assert ask(cors, "127.0.0.1:8000", "http://app.example:3000")[0] == 200
    status, error = ask(Policy(None, trusted_hosts=("llm.example.com",)), "llm.example.com", "http://app.example")
    assert status == 403 and error["code"] == "forbidden_origin"
    assert "start colibri with --allow-origin http://app.example to allow it" in error["message"]


@pytest.mark.parametrize("host", ["http://llm.example.com", "llm.example.com/v1", "a b", "x:port"])
def test_a_trusted_host_that_is_no_host_name_is_one_line(tmp_path, host):
    with pytest.raises(ColibriError, match="--trusted-host: .* is not a host name"):
        ServerConfig(tmp_path, trusted_hosts=(host,))
    ServerConfig(tmp_path, trusted_hosts=("llm.example.com:8443", "10.0.0.7", "[::1]", "*"))


def test_serve_takes_trusted_host(tiny_model):
    one_line_error(colibri("serve", "--model", tiny_model, "--trusted-host", "https://llm.example.com", timeout=60),
                   "--trusted-host: 'https://llm.example.com' is not a host name")
