"""Print pyproject.toml's dependency floors as pins, one `name==version` a line, for pip.

    python scripts/floors.py [--with-torch] [EXTRA ...] > floors.txt   # dependencies + the extras named

Every `name>=version` becomes `name==version`, so that a venv built from the output runs the
code at the lowest versions pyproject.toml promises (scripts/test_floor.sh). torch is left
out unless asked for: on a machine without a GPU its floor cannot be installed (PyPI's older
torch wheels are CUDA builds of several GB, and the CPU wheel on disk is one version), so
the floor venv there uses the torch that `scripts/setup.sh` installs. A dependency without a
`>=` floor is an error: there would be nothing to test.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

CPU_UNTESTED = {"torch"}
"""Floors left out unless `--with-torch` (see the module docstring)."""


def floors(pyproject: Path, extras: list[str], *, with_torch: bool = False) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"unknown extra {extra!r}; known: {', '.join(project['optional-dependencies'])}")
        requirements += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][A-Za-z0-9.]*)", requirement.strip())
        if match is None:
            raise SystemExit(f"{requirement!r}: not of the form name>=version")
        name, version = match.groups()
        if with_torch or name.lower() not in CPU_UNTESTED:
            pins[name.lower()] = version
    return [f"{name}=={version}" for name, version in pins.items()]


if __name__ == "__main__":
    args = sys.argv[1:]
    with_torch = "--with-torch" in args
    extras = [a for a in args if a != "--with-torch"]
    print("\n".join(floors(Path(__file__).resolve().parent.parent / "pyproject.toml", extras, with_torch=with_torch)))
