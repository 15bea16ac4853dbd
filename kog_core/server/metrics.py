"""Prometheus metrics in the text exposition format (version 0.0.4), without a dependency.

kog serves one model in one process, so a few counters, gauges and histograms guarded by one
lock are all it needs; `prometheus_client` would add a dependency for no gain (no multiprocess
mode, no push gateway). Metric names follow Prometheus conventions (`_total`, `_seconds`)."""
from __future__ import annotations

import bisect
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}" if labels else ""


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) if abs(v) < 2**53 else repr(float(v))


class _Histogram:
    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float):
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1


class Metrics:
    def __init__(self, model_name: str):
        self.model = model_name
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}     # (endpoint, status code) -> count
        self.finished: dict[str, int] = {}                  # finish_reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.queue_wait = _Histogram(TTFT_BUCKETS)
        self.queue_depth = 0        # waiting, not counting the running one
        self.running = 0
        self.rejected = 0           # 429s

    def count_request(self, endpoint: str, status: int):
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            if status == 429:
                self.rejected += 1

    def observe_first_token(self, ttft_s: float):
        with self._lock:
            self.ttft.observe(ttft_s)

    def observe_inter_token(self, gap_s: float):
        with self._lock:
            self.itl.observe(gap_s)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, finish_reason: str,
                         queue_s: float, e2e_s: float):
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.queue_wait.observe(queue_s)
            self.e2e.observe(e2e_s)

    def set_queue(self, waiting: int, running: int):
        with self._lock:
            self.queue_depth, self.running = waiting, running

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": sum(self.requests.values()), "prompt_tokens": self.prompt_tokens,
                    "generation_tokens": self.generation_tokens, "waiting": self.queue_depth,
                    "running": self.running, "rejected": self.rejected,
                    "completed": sum(self.finished.values())}

    def render(self) -> str:
        m = (("model", self.model),)
        out: list[str] = []

        def head(name, kind, help_):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        def hist(name, help_, h: _Histogram):
            head(name, "histogram", help_)
            cum = 0
            for bound, c in zip(h.bounds + (float("inf"),), h.counts):
                cum += c
                out.append(f"{name}_bucket{_labels(m + (('le', _num(bound)),))} {cum}")
            out.append(f"{name}_sum{_labels(m)} {_num(h.sum)}")
            out.append(f"{name}_count{_labels(m)} {h.count}")

        with self._lock:
            head("kog_requests_total", "counter", "HTTP requests to the API, by endpoint and status code.")
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(f"kog_requests_total{_labels(m + (('endpoint', endpoint), ('status', status)))} {n}")
            head("kog_request_finished_total", "counter", "Generations finished, by finish reason.")
            for reason, n in sorted(self.finished.items()):
                out.append(f"kog_request_finished_total{_labels(m + (('finish_reason', reason),))} {n}")
            head("kog_prompt_tokens_total", "counter", "Prompt tokens processed.")
            out.append(f"kog_prompt_tokens_total{_labels(m)} {self.prompt_tokens}")
            head("kog_generation_tokens_total", "counter", "Tokens generated.")
            out.append(f"kog_generation_tokens_total{_labels(m)} {self.generation_tokens}")
            head("kog_requests_rejected_total", "counter", "Requests rejected with 429 because the queue was full.")
            out.append(f"kog_requests_rejected_total{_labels(m)} {self.rejected}")
            head("kog_queue_depth", "gauge", "Requests waiting in the FIFO queue (not counting the running one).")
            out.append(f"kog_queue_depth{_labels(m)} {self.queue_depth}")
            head("kog_requests_running", "gauge", "Requests being decoded (0 or 1: batch 1).")
            out.append(f"kog_requests_running{_labels(m)} {self.running}")
            hist("kog_time_to_first_token_seconds", "Request arrival to first generated token (includes queue wait).",
                 self.ttft)
            hist("kog_inter_token_latency_seconds", "Time between consecutive streamed tokens.", self.itl)
            hist("kog_queue_wait_seconds", "Time a request waited in the queue before decoding started.",
                 self.queue_wait)
            hist("kog_e2e_request_latency_seconds", "Request arrival to the end of its generation.", self.e2e)
        return "\n".join(out) + "\n"
