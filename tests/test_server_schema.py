"""The published OpenAPI document (/openapi.json), and schemathesis fuzzing the server against it:
no 5xx, no hang, every response (status, content type, headers, body, server-sent events) as the
document says, every request the document forbids refused with a 4xx, the key enforced.

CI runs a bounded campaign with a fixed seed (SCHEMATHESIS_EXAMPLES per operation); RELIABILITY.md
records a longer one (COLIBRI_SCHEMATHESIS_EXAMPLES=100 ...).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_core.server import ServerConfig, create_app
from colibri_core.server import schemas
from colibri_core.server.app import Server
from live_server import LiveServer

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("COLIBRI_SCHEMATHESIS_EXAMPLES", "12"))
SEED = int(os.environ.get("COLIBRI_SCHEMATHESIS_SEED", "22"))
# every check schemathesis has but one: positive_data_acceptance expects every schema-valid request
# to succeed, while some are refused by what no static schema can say (a prompt longer than the
# context once tokenized, an empty prompt, a conversation the chat template refuses); those answers
# are documented 4xx, which status_code_conformance checks
CHECKS = ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = LiveServer("serve", tiny_model, "--api-key", KEY, "--max-tokens", "8", "--queue", "64",
                   "--model-name", "tiny")
    yield s
    s.stop()
    assert "Traceback" not in s.text_log() and "internal error" not in s.text_log(), s.text_log()


def document(server) -> dict:
    status, body = server.get("/openapi.json", {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    return json.loads(body)


def test_the_document_is_generated_from_the_request_models(server):
    """The request bodies are the models the handlers validate with, at this server's limits."""
    doc = document(server)
    assert doc["openapi"] == "3.1.0" and doc["security"] == [{"bearer": []}]
    lim = schemas.Limits(context=4096, vocab=300, max_tokens=8)
    components = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", schemas.ChatBody), ("/v1/completions", schemas.CompletionBody),
                        ("/tokenize", schemas.TokenizeBody), ("/detokenize", schemas.DetokenizeBody)):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model.__name__}"}, path
        generated = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, schema in {**generated.pop("$defs", {}), model.__name__: generated}.items():
            assert components[name] == json.loads(json.dumps(schemas.limited(schema, lim))), (path, name)
    max_tokens = components["CompletionBody"]["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens == {"type": "integer", "minimum": 1, "maximum": 8}  # --max-tokens, as the handlers enforce it
    assert "x-limit" not in json.dumps(doc)  # every placeholder filled in
    assert doc["paths"]["/health"]["get"]["security"] == []  # the one open endpoint


@pytest.mark.parametrize("dashboard", [False, True])
def test_every_route_is_documented(tiny_model, dashboard):
    app = create_app(ServerConfig(tiny_model, dashboard=dashboard))
    server: Server = app.state.server
    from colibri_core.server.openapi import document as doc_of

    doc = doc_of(server.limits, model_id="m", api_key=False, dashboard=dashboard)
    routes = {r.path.replace("{model:path}", "{model}") for r in app.routes}
    documented = {p for p in doc["paths"]}
    assert routes - {"/static"} <= documented and ("/static/{file}" in documented) == dashboard
    assert documented - {"/static/{file}"} <= routes


@pytest.mark.system
def test_schemathesis_finds_nothing(server, tmp_path):
    """The fuzzing campaign: every operation, positive and negative data, stateful links, all checks."""
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run", server.url + "/openapi.json",
           *CHECKS, "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--workers", "1",
           "-H", f"Authorization: Bearer {KEY}", "--request-timeout", "60", "--generation-database", "none",
           "--no-color"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = r.stdout + r.stderr
    summary = re.search(r"(\d+) generated, (\d+) (?:passed|found)", out)
    print(" ".join(cmd[1:]).replace(KEY, "KEY"), "→", summary.group(0) if summary else "no summary")
    assert r.returncode == 0, out[-6000:]
    assert summary and int(summary.group(1)) >= 200, out[-3000:]
