"""`anatomist serve --write-space DIR`: a folder that runs the same page as a Hugging Face Space.

A Docker Space (the README's front matter says `sdk: docker`, `app_port: 7860`): `app.py` calls
`anatomist serve` on every interface, the `Dockerfile` installs CPU torch and `requirements.txt`
(anatomist's dependencies and the `web` extra's), and `anatomist/` is this installed package,
copied, so the Space needs no release of anatomist on PyPI. Push the folder to a Space repository.
"""

from __future__ import annotations

import re
import shutil
from importlib import metadata
from pathlib import Path

from anatomist.errors import InputError

TEMPLATE = Path(__file__).resolve().parent / "space_template"
WEB_REQUIREMENTS = ("starlette>=0.40", "uvicorn>=0.30")
"""pyproject.toml's `web` extra (a test keeps the two alike): the installed metadata may predate it."""


def requirements() -> list[str]:
    """anatomist's own dependencies (the installed metadata's, without extras) and the web extra's.

    Raises:
        InputError: anatomist runs from a source folder that was never installed (no metadata).
    """
    try:
        declared = metadata.requires("anatomist") or []
    except metadata.PackageNotFoundError:
        raise InputError("anatomist is not installed (pip install -e . in its checkout): the Space's "
                         "requirements.txt is made from the installed package's dependencies") from None
    core = [r for r in declared if ";" not in r]
    names = {re.split(r"[<>=!~ \[]", r, maxsplit=1)[0].lower() for r in core}
    return core + [r for r in WEB_REQUIREMENTS if r.split(">=")[0] not in names]


def write_space(folder: str | Path) -> list[Path]:
    """Write the Space into `folder` (created; it must be empty) and return the files written at its top.

    Raises:
        InputError: `folder` exists and is not an empty directory, or anatomist is not installed.
    """
    target, wanted = Path(folder), requirements()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InputError(f"--write-space {str(target)!r}: not an empty folder; name a new one")
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("README.md", "Dockerfile", "app.py"):
        shutil.copyfile(TEMPLATE / name, target / name)
        written.append(target / name)
    (target / "requirements.txt").write_text("\n".join(wanted) + "\n")
    written.append(target / "requirements.txt")
    package = Path(__file__).resolve().parent.parent
    shutil.copytree(package, target / "anatomist", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    written.append(target / "anatomist")
    return written
