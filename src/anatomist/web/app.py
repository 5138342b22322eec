"""The page's HTTP routes (Starlette): the static page, its schema, uploads, jobs, charts and files.

    GET  /                                   the page (static/index.html; its state is the URL query)
    GET  /favicon.ico                        the page's icon (static/favicon.svg)
    GET  /api/schema                         fields, model and GPU catalogs, memory categories
    POST /api/uploads                        {"kind": "config"|"recipe", "name", "text"} -> {"id", "name", "kind"}
    GET  /api/uploads/{id}                   {"id", "name", "kind"} of an upload a link names
    POST /api/run                            {"view": ..., field: value, ...} -> a job (its answer when quick)
    GET  /api/jobs/{id}                      the job: status, traces done / to do, its view or error
    GET  /api/jobs/{id}/charts/{name}.png    a report chart of the answer (memory, throughput)
    GET  /api/jobs/{id}/files/{pick}/{target}[/{name}]   the emitted files of a pick: the list, or one file

Bad input is HTTP 400 with {"error": "one line"}; anything unexpected is a generic line (500), its
traceback in the server's log. The page loads nothing from elsewhere: a Content-Security-Policy
of 'self' says so to the browser too.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from anatomist.errors import InputError
from anatomist.web import capture, service
from anatomist.web.form import FieldError, parse
from anatomist.web.jobs import Busy, Job, JobRunner
from anatomist.web.uploads import MAX_UPLOAD_BYTES, UploadStore

log = logging.getLogger("anatomist.web")

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY_BYTES = 2 * MAX_UPLOAD_BYTES + 16 * 1024
"""A request body: an upload's text escaped into JSON (at most twice its size) and its envelope."""
INLINE_WAIT_S = 0.4
"""How long /api/run waits for its job before answering "running": a warm estimate answers in one round trip."""
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                                 b"base-uri 'none'; frame-ancestors 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


@dataclass(kw_only=True, slots=True)
class State:
    """What the routes share: the uploads, the jobs, and whether configs may come from the Hub."""

    uploads: UploadStore
    jobs: JobRunner
    allow_network: bool
    schema: dict[str, Any] | None = None


def create_app(*, allow_network: bool = False, allowed_hosts: list[str] | None = None) -> ASGIApp:
    """The page's app. `allowed_hosts`: the Host headers answered (None: any), so that a page elsewhere
    cannot reach a server bound to localhost through DNS rebinding."""
    state = State(uploads=UploadStore(), jobs=JobRunner(), allow_network=allow_network)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        capture.install()
        state.jobs.warm_up(service.warm_up)  # torch, transformers and the estimator imported before a request
        try:
            yield
        finally:
            state.jobs.close()
            state.uploads.close()

    routes = [
        Route("/", lambda request: FileResponse(STATIC / "index.html")),
        Route("/favicon.ico", lambda request: FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")),
        Route("/api/schema", _with(state, schema)),
        Route("/api/uploads", _with(state, upload), methods=["POST"]),
        Route("/api/uploads/{upload_id}", _with(state, upload_info)),
        Route("/api/run", _with(state, run), methods=["POST"]),
        Route("/api/jobs/{job_id}", _with(state, job_status)),
        Route("/api/jobs/{job_id}/charts/{chart}.png", _with(state, chart)),
        Route("/api/jobs/{job_id}/files/{pick:int}/{target}", _with(state, files)),
        Route("/api/jobs/{job_id}/files/{pick:int}/{target}/{name}", _with(state, files)),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)] if allowed_hosts else []
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    return _SecurityHeaders(app)


def _with(state: State, handler: Any) -> Any:
    """The route calling `handler(state, request)` once the warm-up is over, its errors as JSON."""
    async def endpoint(request: Request) -> Response:
        await state.jobs.ready()
        try:
            return await handler(state, request)
        except _TooLarge as exc:
            return _error(str(exc), 413)
        except FieldError as exc:
            return JSONResponse({"error": str(exc), "field": exc.field}, status_code=400)
        except InputError as exc:
            return _error(str(exc), 400)
        except Busy as exc:
            return _error(str(exc), 503)
    return endpoint


async def schema(state: State, request: Request) -> Response:
    if state.schema is None:  # the Recipe's defaults import transformers: once, off the event loop
        state.schema = await run_in_threadpool(lambda: service.schema(allow_network=state.allow_network))
    return JSONResponse(state.schema)


async def upload(state: State, request: Request) -> Response:
    body = await _json_body(request)
    kind, name, text = body.get("kind"), body.get("name") or "", body.get("text")
    if not isinstance(text, str) or not isinstance(name, str) or not isinstance(kind, str):
        raise InputError('an upload is {"kind": "config" or "recipe", "name": "...", "text": "the file\'s content"}')
    item = state.uploads.add(kind, name, text)
    try:
        await run_in_threadpool(service.check_upload, item, state.uploads)
    except InputError:
        state.uploads.forget(item.id)
        raise
    return JSONResponse({"id": item.id, "name": item.name, "kind": item.kind})


async def upload_info(state: State, request: Request) -> Response:
    upload_id = request.path_params["upload_id"]
    item = state.uploads.find(upload_id)
    if item is None:
        raise HTTPException(404, "that upload is not on this server any more (it restarted or forgot it): upload it again")
    return JSONResponse({"id": item.id, "name": item.name, "kind": item.kind})


async def run(state: State, request: Request) -> Response:
    params = await _json_body(request)
    fields = await run_in_threadpool(service.fields)
    form = parse(params, fields)
    job = state.jobs.submit(form.key(), lambda progress: service.run_view(
        form, state.uploads, allow_network=state.allow_network, progress=progress),
        command=service.command_of(form, state.uploads))
    await state.jobs.wait(job, INLINE_WAIT_S)
    return _job_response(job)


async def job_status(state: State, request: Request) -> Response:
    return _job_response(_job(state, request))


async def chart(state: State, request: Request) -> Response:
    job, name = _done(state, request), request.path_params["chart"]
    key = f"chart:{name}"
    if key not in job.cache:
        assert job.view is not None  # _done
        job.cache[key] = await run_in_threadpool(service.chart_png, job.view, name)
    return Response(job.cache[key], media_type="image/png", headers={"cache-control": "private, max-age=3600"})


async def files(state: State, request: Request) -> Response:
    job = _done(state, request)
    pick, target = request.path_params["pick"], request.path_params["target"]
    key = f"files:{pick}:{target}"
    if key not in job.cache:
        assert job.view is not None  # _done
        job.cache[key] = await run_in_threadpool(service.emitted_files, job.view, pick, target)
    emitted: dict[str, str] = job.cache[key]
    name = request.path_params.get("name")
    if name is None:
        base = f"/api/jobs/{job.id}/files/{pick}/{target}"
        return JSONResponse({"files": [{"name": n, "url": f"{base}/{n}", "text": t} for n, t in emitted.items()]})
    if name not in emitted:
        raise InputError(f"no file {name!r} for {target}; there are: {', '.join(emitted)}")
    media = "application/json" if name.endswith(".json") else "text/x-python" if name.endswith(".py") else "text/yaml"
    return Response(emitted[name], media_type=media, headers={"content-disposition": f'attachment; filename="{name}"'})


def _job(state: State, request: Request) -> Job:
    job = state.jobs.get(request.path_params["job_id"])
    if job is None:
        raise HTTPException(404, "no such job on this server (it restarted, or forgot it): run it again")
    return job


def _done(state: State, request: Request) -> Job:
    job = _job(state, request)
    if job.status != "done" or job.view is None:
        raise InputError(f"job {job.id} has no answer ({job.status})")
    return job


def _job_response(job: Job) -> Response:
    body = job.to_dict()
    if job.status == "error":
        return JSONResponse({**body, "error": job.error}, status_code=500 if job.internal else 400)
    return JSONResponse(body, status_code=200 if job.status == "done" else 202)


async def _json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, refused past MAX_BODY_BYTES without reading the rest."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _TooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _TooLarge()
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise InputError("the request is not JSON") from None
    if not isinstance(body, dict):
        raise InputError("the request must be a JSON object")
    return body


class _TooLarge(InputError):
    def __init__(self) -> None:
        super().__init__(f"the request is larger than {MAX_BODY_BYTES // 1024} KiB: uploads are limited to "
                         f"{MAX_UPLOAD_BYTES // 1024} KiB")


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(str(exc.detail), exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error("the server could not answer this (an internal error, logged on the server): reload the page and "
                  "try again; if it fails again, the server's log says what failed", 500)


class _SecurityHeaders:
    """Adds SECURITY_HEADERS to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)
