"""The server's own logic (queue, cancellation, one-at-a-time, SSE, errors) against a fake engine:
fast, and runs without the demo model. tests/test_server.py covers the real model end to end."""
from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kog_core.config import KogConfig, ServerSection  # noqa: E402
from kog_core.engine import GenerationResult, StreamChunk  # noqa: E402
from kog_core.errors import KogError  # noqa: E402
from kog_core.server.app import create_app  # noqa: E402


class FakeEngine:
    """Generates "<p>.<i> " for i = 0.. where p is the prompt's first id; 10 ms per token."""

    def __init__(self, step_s=0.01):
        self.config = KogConfig.model_validate({"model": {"name": "fake"}})
        self.program = SimpleNamespace(context_length=64, vocab_size=1000)
        self.backend = SimpleNamespace(name="fake")
        self.prefix_reuse = False  # Engine's attribute, which create_app narrows by [server] prefix_reuse
        self.step_s = step_s
        self.active = 0
        self.overlap = False
        self.cancelled = []
        self.held_tail = ""   # text the fake "held back" and only puts in the final result

    def encode_prompt(self, prompt, chat=None):
        if isinstance(prompt, str):
            return [len(prompt) % 1000] + [7] * (len(prompt) // 4)
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return [len(items[-1]["content"]) % 1000] + [7] * (len(items[-1]["content"]) // 4)
        if any(not 0 <= int(t) < 1000 for t in items):
            raise KogError("token id outside the vocabulary")
        return [int(t) for t in items]

    def stream(self, ids, *, max_tokens=None, cancel=None, chat=None, **kw):
        self.active += 1
        self.overlap |= self.active > 1
        try:
            n = min(max_tokens, self.program.context_length - len(ids))
            out = []
            for i in range(n):
                if cancel.cancelled:
                    self.cancelled.append(ids[0])
                    break
                time.sleep(self.step_s)
                out.append(i)
                yield StreamChunk(f"{ids[0]}.{i} ", [i])
            text = "".join(f"{ids[0]}.{i} " for i in out) + self.held_tail
            finish = "cancelled" if cancel.cancelled else "length"
            yield StreamChunk("", [], GenerationResult(out, text, finish, len(ids), 0.01, 100.0, 0.1))
        except GeneratorExit:  # the worker closed us: the client went away
            self.cancelled.append(ids[0] if cancel.cancelled else -1)
            raise
        finally:
            self.active -= 1


@pytest.fixture
def fake():
    return FakeEngine()


@pytest.fixture
def serve(fake):
    servers = []

    def start(**cfg):
        app = create_app(fake, ServerSection(**{"stats_interval_s": 60, **cfg}))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
        t.start()
        while not srv.started:
            time.sleep(0.01)
        servers.append((srv, t, sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}", app

    yield start
    for srv, t, sock in servers:
        srv.should_exit = True
        t.join(5)
        sock.close()


def test_concurrent_requests_run_one_at_a_time_in_order(serve, fake):
    url, _ = serve(queue_size=32)
    results = {}

    def one(i):
        body = {"prompt": [100 + i], "max_tokens": 5, "stream": bool(i % 2)}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        if body["stream"]:
            results[i] = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.split("\n\n")
                                 if line.startswith("data: {"))
        else:
            results[i] = r.json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {i: "".join(f"{100 + i}.{k} " for k in range(5)) for i in range(20)}
    assert not fake.overlap


def test_queue_full_429_and_cancel_while_queued(serve, fake):
    fake.step_s = 0.05
    url, app = serve(queue_size=1)
    with httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 60, "stream": True}) as running:
            lines = running.iter_lines()   # keep it: a discarded iterator closes the connection
            next(lines)
            with httpx.Client(base_url=url, timeout=30) as c2:
                with c2.stream("POST", "/v1/completions", json={"prompt": [2], "max_tokens": 3, "stream": True}):
                    for _ in range(100):
                        if c.get("/health").json()["waiting"] == 1:
                            break
                        time.sleep(0.01)
                    r = c.post("/v1/completions", json={"prompt": [3], "max_tokens": 1})
                    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                    assert r.json()["error"]["type"] == "rate_limit_error"
            # the queued client left: its slot is free again, it never runs
            for _ in range(100):
                if c.get("/health").json()["waiting"] == 0:
                    break
                time.sleep(0.01)
            assert c.get("/health").json()["waiting"] == 0
        t0 = time.perf_counter()
        r = c.post("/v1/completions", json={"prompt": [4], "max_tokens": 2})
        assert r.status_code == 200 and time.perf_counter() - t0 < 1.0   # the long one was cancelled
    assert 1 in fake.cancelled and 2 not in fake.cancelled
    assert 'finish_reason="cancelled"} 2' in httpx.get(url + "/metrics").text


def test_held_back_tail_is_streamed(serve, fake):
    """Text the engine still held back when generation ended reaches the stream before the finish."""
    fake.held_tail = "TAIL"
    url, _ = serve()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "abcd"}],
                                                       "max_tokens": 2, "stream": True}, timeout=30)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == "4.0 4.1 TAIL"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert r.text.endswith("data: [DONE]\n\n")


def test_max_tokens_clamped_to_context(serve, fake):
    url, _ = serve()
    r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 60, "max_tokens": 1000}, timeout=30).json()
    assert r["usage"] == {"prompt_tokens": 60, "completion_tokens": 4, "total_tokens": 64,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert r["choices"][0]["finish_reason"] == "length"
    r = httpx.post(url + "/v1/completions", json={"prompt": [5] * 64}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_engine_error_is_400_not_500(serve):
    url, _ = serve()
    r = httpx.post(url + "/v1/completions", json={"prompt": [5000]}, timeout=30)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_metrics_exposition_is_well_formed(serve):
    url, _ = serve(api_key="k")
    h = {"Authorization": "Bearer k"}
    httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 3}, headers=h, timeout=30)
    text = httpx.get(url + "/metrics", headers=h).text
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            assert any(name == n or name.startswith(n + "_") for n in names), line
            float(line.rsplit(" ", 1)[1])
    assert 'kog_generation_tokens_total{model="fake"} 3' in text
    assert 'le="+Inf"' in text
