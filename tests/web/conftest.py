"""The page's server, in this process: uvicorn in a thread on a free port of 127.0.0.1, and a small HTTP client.

In-process, so the tests share the session's imported torch, as the real server keeps it warm;
`anatomist serve` itself, in a fresh process, is tested in test_serve.py.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web extra is not installed (pip install -e '.[web]' or '.[dev]')")
pytest.importorskip("uvicorn", reason="the web extra is not installed (pip install -e '.[web]' or '.[dev]')")

TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 48, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 512,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}
"""A Llama no other test traces (hidden 48, vocabulary 512): its first estimate in a module is cold."""


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


@dataclass(slots=True)
class LiveServer:
    url: str
    """http://127.0.0.1:PORT/"""

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None) -> Reply:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url.rstrip("/") + path, data=data, method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, payload, got = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            status, payload, got = exc.code, exc.read(), dict(exc.headers)
        kind = got.get("content-type", "")
        return Reply(status, json.loads(payload) if kind.startswith("application/json") and payload else payload,
                     {k.lower(): v for k, v in got.items()})

    def upload(self, kind: str, name: str, text: str) -> Reply:
        return self.request("POST", "/api/uploads", {"kind": kind, "name": name, "text": text})

    def run(self, params: dict[str, Any], timeout_s: float = 300) -> tuple[Reply, float]:
        """POST /api/run, then poll the job until it is finished: (the last reply, seconds it all took)."""
        start = time.perf_counter()
        reply = self.request("POST", "/api/run", params)
        while reply.status == 202:
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"job {reply.body['id']} still {reply.body['status']}")
            time.sleep(0.05)
            reply = self.request("GET", f"/api/jobs/{reply.body['id']}")
        return reply, time.perf_counter() - start


def start_server(*, allow_network: bool = False) -> tuple[LiveServer, Any, threading.Thread]:
    import uvicorn

    from anatomist.web.app import create_app
    from anatomist.web.server import LOOPBACK_HOSTS, listen, url_of

    sock = listen("127.0.0.1", 0)
    app = create_app(allow_network=allow_network, allowed_hosts=LOOPBACK_HOSTS)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(url=url_of(sock)), server, thread


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    """A server for the module (its jobs and uploads shared by the module's tests, as by a page's users)."""
    live, server, thread = start_server()
    yield live
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path
