"""`anatomist serve`: the estimate and the plan on a page, at http://127.0.0.1:7860/ (the `web` extra)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="a page for estimate and plan, to open and share (pip install 'anatomist[web]')")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860; 0: any free one)")
    p.add_argument("--allow-network", action="store_true",
                   help="let the page read a model's config from the Hub by its id (otherwise: catalog, local HF "
                        "cache and uploads only)")
    p.add_argument("--write-space", metavar="DIR", default=None,
                   help="write a Hugging Face Space (Docker) that runs this page into DIR, and exit")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.write_space:
        from anatomist.web.hf_space import write_space

        written = write_space(args.write_space)
        print(f"wrote the Space into {args.write_space} ({len(written)} files); see its README.md to deploy it",
              file=sys.stderr)
        return 0
    from anatomist.web.server import serve

    def ready(url: str) -> None:
        print(f"anatomist serve: {url}  (Ctrl-C to stop)", flush=True)

    try:
        serve(host=args.host, port=args.port, allow_network=args.allow_network, on_ready=ready)
    except KeyboardInterrupt:  # Ctrl-C is how a server stops: uvicorn has shut down, then re-raised it
        print("anatomist serve: stopped", file=sys.stderr)
    return 0
