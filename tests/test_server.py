"""`kog serve`: a real uvicorn server on loopback, the reference (CPU) backend and the SmolLM2 demo
model, driven by the official `openai` client and by raw HTTP (httpx).

The engine is loaded once (conftest's session `demo_engine`); every greedy reference text is
computed on it before the server starts, so the test never runs the engine from two threads."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from kog_core.config import ServerSection  # noqa: E402
from kog_core.server.app import create_app  # noqa: E402

KEY = "sk-test-key"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION = "The capital of France is"
N_CHAT, N_COMP = 8, 10
CONCURRENT = [f"{w} number {i} is" for i, w in enumerate(["The", "My", "Your", "Our", "A"] * 4)]
N_CONC = 5


@pytest.fixture(scope="module")
def expected(demo_engine):
    e = demo_engine
    g = lambda p, n, **kw: e.generate(p, max_tokens=n, temperature=0.0, **kw)  # noqa: E731
    chat = g(CHAT, N_CHAT)
    comp = g(COMPLETION, N_COMP, chat=False)
    # a stop string taken from the middle of the greedy completion
    words = comp.text.split()
    stop = words[len(words) // 2] if len(words) >= 2 else comp.text[len(comp.text) // 2:]
    return {"chat": chat, "comp": comp, "stop": stop,
            "stop_text": comp.text[:comp.text.find(stop)],
            "concurrent": [g(p, N_CONC, chat=False).text for p in CONCURRENT],
            "chat_prompt_tokens": len(e.encode_prompt(CHAT)),
            "comp_prompt_tokens": len(e.encode_prompt(COMPLETION, chat=False))}


@pytest.fixture(scope="module")
def server(demo_engine, expected):
    cfg = ServerSection(api_key=KEY, queue_size=24, max_body_bytes=256 * 1024, stats_interval_s=0.5,
                        served_model_name="smol")
    app = create_app(demo_engine, cfg)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    yield {"url": f"http://127.0.0.1:{port}", "app": app, "engine": demo_engine}
    srv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def _metric(http, name: str) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_idle(http, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        h = http.get("/health").json()
        if h["running"] == 0 and h["waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server never became idle")


# ----------------------------------------------------------------------------- basics

def test_models_health_metrics(client, http, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["smol"]
    ctx = server["engine"].program.context_length
    assert http.get("/v1/models").json()["data"][0]["context_length"] == ctx
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"      # no key needed
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("kog_requests_total", "kog_generation_tokens_total", "kog_time_to_first_token_seconds_bucket",
                 "kog_inter_token_latency_seconds_bucket", "kog_queue_depth"):
        assert name in r.text


def test_chat_matches_greedy(client, expected):
    ref = expected["chat"]
    r = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=N_CHAT, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == expected["chat_prompt_tokens"]
    assert r.usage.completion_tokens == ref.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="smol", messages=CHAT, max_completion_tokens=N_CHAT,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.completion_tokens
    assert chunks[-1].usage.prompt_tokens == expected["chat_prompt_tokens"]
    # the same prompt again: its KV cache was the last request's, all but the last token reused
    # (and the text above is still the greedy reference's)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected["chat_prompt_tokens"] - 1
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_match_greedy_and_length(client, expected):
    ref = expected["comp"]
    assert ref.finish_reason == "length"
    r = client.completions.create(model="smol", prompt=COMPLETION, max_tokens=N_COMP, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected["comp_prompt_tokens"], N_COMP)
    chunks = list(client.completions.create(model="smol", prompt=COMPLETION, max_tokens=N_COMP, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_string_never_leaks(client, expected):
    stop, want = expected["stop"], expected["stop_text"]
    r = client.completions.create(model="smol", prompt=COMPLETION, max_tokens=N_COMP, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="smol", prompt=COMPLETION, max_tokens=N_COMP, temperature=0,
                                            stop=stop, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == want and stop not in "".join(pieces)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_raw_sse_format(http, expected):
    body = {"model": "smol", "messages": CHAT, "max_tokens": N_CHAT, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == payloads[0]["id"] for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == expected["chat"].finish_reason
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads) == expected["chat"].text


def test_token_id_prompt(http, server, expected):
    ids = server["engine"].encode_prompt(COMPLETION, chat=False)
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": N_COMP, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["comp"].text


@pytest.mark.slow
def test_same_text_as_kog_run(client, demo_gguf):
    """The server's greedy chat answer is exactly what `kog run` prints."""
    proc = subprocess.run([sys.executable, "-m", "kog_core.cli", "run", "--model", str(demo_gguf), "--backend",
                           "reference", "-n", str(N_CHAT), "--temperature", "0", "--json", CHAT[0]["content"]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    r = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=N_CHAT, temperature=0)
    assert r.choices[0].message.content == run["text"]
    assert r.choices[0].finish_reason == run["finish_reason"]


# ----------------------------------------------------------------------------- concurrency

def test_twenty_concurrent_clients(client, expected, http):
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int):
        try:
            if i % 2:
                chunks = client.completions.create(model="smol", prompt=CONCURRENT[i], max_tokens=N_CONC,
                                                   temperature=0, stream=True)
                results[i] = "".join(c.choices[0].text for c in chunks)
            else:
                results[i] = client.completions.create(model="smol", prompt=CONCURRENT[i], max_tokens=N_CONC,
                                                       temperature=0).choices[0].text
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [results[i] for i in range(len(CONCURRENT))] == expected["concurrent"]


def _start_long_stream(server, max_tokens=400):
    """A streaming request that runs for a long time; returns (client, response) once it is decoding."""
    c = httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    req = c.build_request("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": max_tokens,
                                                           "temperature": 0, "stream": True, "ignore_eos": True})
    resp = c.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    got = 0
    for line in lines:
        if line.startswith("data: {"):
            got += 1
            if got == 2:
                break
    return c, resp, lines


def test_queue_overflow_gets_429(server, http):
    _wait_idle(http)
    sched = server["app"].state.scheduler
    old = sched.queue_size
    sched.queue_size = 1
    c, resp, lines = _start_long_stream(server)
    try:
        waiting = threading.Thread(target=lambda: http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        waiting.start()
        for _ in range(200):
            if http.get("/health").json()["waiting"] == 1:
                break
            time.sleep(0.02)
        assert http.get("/health").json() == {"status": "ok", "model": "smol", "running": 1, "waiting": 1}
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 429
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0).completions.create(
                model="smol", prompt="Hi", max_tokens=2)
        assert _metric(http, "kog_requests_rejected_total") >= 2
    finally:
        sched.queue_size = old
        resp.close()
        c.close()
    waiting.join(120)
    _wait_idle(http)


def test_disconnect_cancels_generation(server, http, client, expected):
    _wait_idle(http)
    # how long a short request takes on an idle server
    t0 = time.perf_counter()
    client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0)
    short = time.perf_counter() - t0
    cancelled_before = _metric(http, 'kog_request_finished_total{model="smol",finish_reason="cancelled"}')

    c, resp, lines = _start_long_stream(server, max_tokens=400)   # ~400 tokens: tens of seconds if not cancelled
    t_close = time.perf_counter()
    resp.close()
    c.close()
    t0 = time.perf_counter()
    client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0)
    after = time.perf_counter() - t0
    # the next request starts at once: it waits at most a token or two for the cancelled one
    assert after < short + 3.0, (after, short)
    assert _metric(http, 'kog_request_finished_total{model="smol",finish_reason="cancelled"}') == cancelled_before + 1
    assert time.perf_counter() - t_close < 30

    # a non-streaming client that gives up is cancelled too (the server polls for the disconnect)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0,
                   json={"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                         "ignore_eos": True})
    t0 = time.perf_counter()
    _wait_idle(http, timeout=10)
    assert time.perf_counter() - t0 < 5
    assert _metric(http, 'kog_request_finished_total{model="smol",finish_reason="cancelled"}') == cancelled_before + 2
    # and the engine's state did not leak: the next greedy answer is unchanged
    r = client.completions.create(model="smol", prompt=COMPLETION, max_tokens=N_COMP, temperature=0)
    assert r.choices[0].text == expected["comp"].text


# ----------------------------------------------------------------------------- auth and validation

def test_api_key_required(server):
    url = server["url"]
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(url + "/v1/chat/completions", json={"messages": CHAT}).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -1}, 400, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["a"] * 40}, 400, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes please"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
])
def test_bad_bodies(http, path, body, status, param):
    r = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] in ("invalid_request_error", "not_found_error") and err["message"]
    if param:
        assert err["param"] == param


def test_unknown_params_are_ignored(http, expected):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": N_CHAT, "temperature": 0,
                                                "user": "me", "store": False, "some_vendor_flag": {"x": 1}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected["chat"].text


def test_body_too_large(http):
    r = http.post("/v1/completions", json={"prompt": "x" * (300 * 1024)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_context_length_exceeded(http, server):
    ctx = server["engine"].program.context_length
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * (ctx + 10)}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages" and str(ctx) in err["message"]
    r = http.post("/v1/completions", json={"prompt": [1] * (ctx + 1)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_request_log_and_stats_lines(client, caplog):
    with caplog.at_level(logging.INFO, logger="kog.server"):
        r = client.completions.create(model="smol", prompt="Hi", max_tokens=2, temperature=0)
        time.sleep(0.8)  # stats_interval_s is 0.5 in this server
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kog.server"]
    assert any(r.id in line and "cached) +" in line and "TTFT" in line and "tok/s" in line for line in lines), lines
    assert any(line.startswith("stats:") for line in lines), lines
