"""Run the page: uvicorn on a socket bound here, the URL said once it listens.

One process, one event loop, one worker thread for the estimates (web/jobs.py): torch, transformers
and the in-memory trace cache stay warm across requests, which is what makes a second estimate of
a model fast. Bound to 127.0.0.1 unless told otherwise; then only Host headers naming this machine
are answered.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable

from anatomist.errors import InputError

LOOPBACK_HOSTS = ["127.0.0.1", "localhost"]
EXTRA_HINT = "pip install 'anatomist[web]'"


def require_extra() -> None:
    """Raises InputError, one line, when the `web` extra (starlette, uvicorn) is not installed."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise InputError(f"anatomist serve needs the web extra ({exc.name} is missing): {EXTRA_HINT}") from None


def set_environment(*, allow_network: bool) -> None:
    """Offline unless asked: HF_HUB_OFFLINE stays set (the CLI sets it) unless configs may come from the Hub.
    Read by huggingface_hub when it is imported, so called before anything imports transformers."""
    if allow_network:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one).

    Raises:
        InputError: the address cannot be bound (in use, not this machine's, not allowed).
    """
    if not 0 <= port <= 65535:
        raise InputError(f"--port must be 0 to 65535, got {port}")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a name such as localhost
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        hint = "; --port 0 picks a free one" if port else ""
        raise InputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def serve(*, host: str = "127.0.0.1", port: int = 7860, allow_network: bool = False,
          on_ready: Callable[[str], None] = print) -> None:
    """Serve the page until interrupted; `on_ready(url)` once the socket listens.

    Raises:
        InputError: the extra is missing, or the address cannot be bound.
    """
    require_extra()
    import uvicorn

    from anatomist.web.app import create_app

    set_environment(allow_network=allow_network)
    sock = listen(host, port)
    app = create_app(allow_network=allow_network, allowed_hosts=LOOPBACK_HOSTS if host in LOOPBACK_HOSTS else None)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=3)
    on_ready(url_of(sock))
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
