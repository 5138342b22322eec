"""`anatomist serve` as a process, the missing extra, and the Hugging Face Space it writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

import anatomist
from anatomist.web.hf_space import WEB_REQUIREMENTS, requirements

SRC = Path(anatomist.__file__).resolve().parents[1]
PYPROJECT = SRC.parent / "pyproject.toml"


@contextmanager
def _process(argv: list[str], *, cwd: Path | None = None, pythonpath: Path = SRC,
             env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start `argv`, read the URL it prints first; SIGINT it at the end and check it stopped cleanly."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(pythonpath), **(env or {})})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("anatomist serve: http://"), (line, proc.stderr.read() if proc.stderr else "")
        yield proc, line.split()[2]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0 and "Traceback" not in err, err


def _get(url: str, host: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.slow
def test_serve_listens_on_localhost_and_prints_its_url() -> None:
    with _process([sys.executable, "-m", "anatomist", "serve", "--port", "0"]) as (_, url):
        assert url.startswith("http://127.0.0.1:")
        status, page = _get(url)
        assert status == 200 and b"<title>anatomist" in page
        assert _get(url, host="anatomist.example")[0] == 400  # a page elsewhere cannot reach it by DNS rebinding


def test_serve_without_the_web_extra_says_what_to_install(cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError, as when it is not installed
    result = cli("serve")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "anatomist: error: anatomist serve needs the web extra (uvicorn is missing): " \
                            "pip install 'anatomist[web]'\n"


def test_a_port_in_use_is_one_line(cli) -> None:  # type: ignore[no-untyped-def]
    from anatomist.web.server import listen

    sock = listen("127.0.0.1", 0)  # the port is taken while it is open
    try:
        result = cli("serve", "--port", str(sock.getsockname()[1]))
    finally:
        sock.close()
    assert result.returncode == 2
    assert result.stderr.startswith("anatomist: error: cannot listen on 127.0.0.1:") and "--port 0" in result.stderr
    assert result.stderr.count("\n") == 1


def test_the_web_extra_is_what_pyproject_declares() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert tuple(extras["web"]) == WEB_REQUIREMENTS
    assert set(WEB_REQUIREMENTS) <= set(extras["dev"])  # the tests run the page
    assert set(WEB_REQUIREMENTS) <= set(requirements())


@pytest.mark.slow
def test_write_space_makes_a_docker_space_that_serves_the_page(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    space = tmp_path / "space"
    result = cli("serve", "--write-space", str(space))
    assert result.returncode == 0, result.stderr
    readme = (space / "README.md").read_text()
    front = yaml.safe_load(readme.split("---\n")[1])
    assert front["sdk"] == "docker" and front["app_port"] == 7860 and len(front["short_description"]) <= 60
    assert "torch --index-url https://download.pytorch.org/whl/cpu" in (space / "Dockerfile").read_text()
    wanted = (space / "requirements.txt").read_text().split()
    assert "starlette>=0.40" in wanted and any(r.startswith("transformers") for r in wanted)
    assert (space / "anatomist" / "web" / "static" / "app.js").exists()
    assert not list(space.rglob("__pycache__"))
    assert cli("serve", "--write-space", str(space)).returncode == 2  # never over a folder with files in it

    # The Space's own app.py, on the package copied into it: the same page.
    with _process([sys.executable, "app.py"], cwd=space, pythonpath=space,
                  env={"PORT": "0", "HOST": "127.0.0.1", "ANATOMIST_ALLOW_NETWORK": "0"}) as (_, url):
        status, page = _get(url)
        assert status == 200 and b"/static/app.js" in page
        assert _get(url + "static/app.js")[0] == 200
