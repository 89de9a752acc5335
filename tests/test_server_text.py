"""Stop strings in streamed text, the request checks, and the engine's timing and routing probe."""
import random
import time

import numpy as np
import pytest

from colibri_core.server.schemas import ApiError, parse_chat, parse_completion
from colibri_core.server.text import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces) + m.flush()
    return out, m.stopped


def test_stop_split_across_pieces_is_hidden():
    assert run(["END"], ["ab", "cE", "N", "Dxyz"]) == ("abc", True)
    assert run(["END"], ["ab", "cE", "Nx"]) == ("abcENx", False)  # a false start is released
    assert run(["\n\n", "##"], ["a\n", "\n#"]) == ("a", True)


def test_stop_matches_brute_force():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abAB\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abAB\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        want = text[: min(hits)] if hits else text
        assert run(stops, pieces) == (want, bool(hits)), (text, stops, pieces)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_k": -2}, "top_k"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
])
def test_chat_checks(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_chat_accepts_text_parts_and_neutral_knobs():
    r = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                    "presence_penalty": 0, "n": 1, "top_k": -1, "stop": "x", "logprobs": False})
    assert r.messages[0]["content"] == "ab" and r.sampling.top_k == 0 and r.sampling.stop == ["x"]


def test_completion_prompt_forms():
    assert parse_completion({"prompt": ["one"]}).prompt == "one"
    assert parse_completion({"prompt": [[1, 2]]}).prompt == [1, 2]
    with pytest.raises(ApiError):
        parse_completion({"prompt": ["one", "two"]})


def test_probe_times_sections_and_counts_routing(tiny_model):
    from colibri_core import load

    with load(tiny_model, cache_slots=1) as engine:
        engine.generate(list(range(3, 20)), 5, stop_ids=())
        s = engine.stats()
        assert s["attention_seconds"] > 0 and s["moe_seconds"] > 0 and s["io_stall_seconds"] > 0
        assert s["moe_seconds"] >= s["io_stall_seconds"]  # the reads are waited for inside the MoE blocks
        routed = engine.probe.routed
        assert sorted(routed) == [0, 1]
        # every token of every pass is routed to top-2 experts in each layer: 17 prompt + 4 decode passes
        assert all(int(c.sum()) == (17 + 4) * 2 for c in routed.values())
        assert engine.probe.passes == 5 and all(len(v) == 2 for v in engine.probe.latest.values())
        # without a listener the layers record nothing
        before = {k: v.copy() for k, v in routed.items()}
        engine.logits(list(range(3, 10)))
        assert all(np.array_equal(before[k], routed[k]) for k in routed)


def test_generation_config_supplies_defaults():
    from types import SimpleNamespace

    from colibri_core.server.app import Server, ServerConfig
    from colibri_core.server.schemas import parse_sampling

    server = Server(ServerConfig("unused"))
    server.engine = SimpleNamespace(generation={"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                "eos_token_id": [7, 8], "max_new_tokens": 50})
    server.context_length = 100
    p = server.resolve(parse_sampling({}), 10, "prompt")
    assert (p.temperature, p.top_p, p.top_k, p.stop_ids, p.max_tokens) == (0.6, 0.95, 20, (7, 8), 50)
    p = server.resolve(parse_sampling({"temperature": 0, "top_k": -1, "ignore_eos": True}), 95, "prompt")
    assert (p.temperature, p.top_k, p.stop_ids, p.max_tokens) == (0.0, 0, (), 5)  # what the context leaves
    server.engine.generation = {"eos_token_id": []}
    p = server.resolve(parse_sampling({}), 10, "prompt")
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 90)  # OpenAI's defaults
    with pytest.raises(ApiError) as e:
        server.resolve(parse_sampling({}), 100, "prompt")
    assert e.value.code == "context_length_exceeded"


class FakeEngine:
    """Yields token 1 then fails, as an engine meeting a damaged expert file does; has the parts a
    snapshot reads (one MoE layer of 2 experts, nothing cached)."""

    def __init__(self, tmp_path):
        from types import SimpleNamespace

        from tokenizers import Tokenizer as HFTokenizer, models

        from colibri_core.probe import Probe
        from colibri_core.store.stats import Placement
        from colibri_core.tokenizer import Tokenizer

        HFTokenizer(models.WordLevel({"y": 0, "x": 1}, unk_token="y")).save(str(tmp_path / "tokenizer.json"))
        self.tokenizer = Tokenizer(tmp_path / "tokenizer.json")  # token 1 is "x"
        self.gate = __import__("threading").Event()
        self.arch = SimpleNamespace(name="fake")
        self.container = SimpleNamespace(moe_layers=[0], n_experts=2, expert_nbytes=1)
        self.store = SimpleNamespace(placement=lambda: Placement(slots=1, cached={0: frozenset()}, pinned={0: frozenset()}))
        self.probe = Probe(2)
        self.resident_bytes = 0

    def stats(self):
        return {"generated_tokens": 0}

    def close(self):
        self.closed = True

    def batch(self):
        from colibri_core.batch import Batch

        return Batch(self.stream, lambda: None)

    def stream(self, ids, max_new_tokens, *args, **kw):
        from colibri_core.errors import ColibriError

        self.gate.wait(30)
        yield 1
        raise ColibriError("expert file experts/layer0.bin is truncated; reconvert the model")


def test_worker_queue_bounds_and_engine_failures(tmp_path):
    import asyncio

    from colibri_core.server.worker import Delta, Failed, Job, Params, QueueFull, Worker

    async def main():
        loop = asyncio.get_running_loop()
        engine = FakeEngine(tmp_path)
        worker = Worker(engine, max_queue=2)
        params = Params(max_tokens=5, temperature=0, top_p=1, top_k=0, seed=None, stop=[], stop_ids=())
        jobs = [Job("completion", [1], params, loop)]
        worker.submit(jobs[0])
        deadline = time.monotonic() + 30
        while not worker.running:  # the first job is taken at once and blocks on the gate
            assert time.monotonic() < deadline and jobs[0].events.empty(), "the first job did not start"
            await asyncio.sleep(0.01)
        jobs += [Job("completion", [1], params, loop) for _ in range(2)]
        for job in jobs[1:]:
            worker.submit(job)
        with pytest.raises(QueueFull) as e:  # running 1 + 2 waiting: the next is refused
            worker.submit(Job("completion", [1], params, loop))
        assert e.value.retry_after >= 1
        worker.cancel(jobs[2])  # a client that leaves frees its place at once
        assert len(worker.waiting) == 1
        worker.submit(Job("completion", [1], params, loop))
        engine.gate.set()
        first = [(await jobs[0].events.get())[1] for _ in range(2)]
        assert isinstance(first[0], Delta) and first[0].text == "x"
        assert isinstance(first[1], Failed) and "truncated" in first[1].message
        worker.stop()
        assert engine.closed  # the worker, its only user, closed it
        assert worker.snapshot.running == ()  # a failed job leaves nothing running behind

    asyncio.run(main())
