"""Uploaded files: a model's config.json, a recipe file, the data's lengths, kept by content so a link can name them.

An upload is text, at most MAX_UPLOAD_BYTES, stored under an id made from its content (the same
file uploaded again gets the same id, so a shared link works again on a restarted server once the
file is uploaded anew). It is written alone into a folder of its own, so the library reads it as
the CLI reads a file on the command line; it is parsed (JSON, or YAML with safe_load), never
executed. Messages name the file as the user named it, never the server's folder.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from anatomist.errors import InputError

MAX_UPLOAD_BYTES = 256 * 1024
"""Largest file accepted. The catalog's biggest config.json is under 4 KiB and a TrainingArguments
JSON with every field under 8 KiB: 256 KiB leaves room for any real one, not for a denial of service."""
MAX_UPLOADS = 128
"""Uploads kept at once (at most 32 MiB); the oldest is forgotten first."""
RECIPE_SUFFIXES = (".json", ".yaml", ".yml")

Kind = Literal["config", "recipe", "lengths"]
KINDS: tuple[str, ...] = ("config", "recipe", "lengths")
WHAT = {"config": "config.json", "recipe": "recipe file", "lengths": "file of lengths"}
"""How a message names an upload of each kind."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Upload:
    id: str
    kind: Kind
    name: str
    """The file name shown to the user (config.json, sft.yaml)."""
    path: Path
    """Where the library reads it: alone in a folder of its own."""


class UploadStore:
    """The uploads of this server process, in a temporary folder removed by `close`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="anatomist-web-"))
        self._uploads: OrderedDict[str, Upload] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, kind: str, name: str, text: str) -> Upload:
        """Keep `text` as an upload of `kind`.

        Raises:
            InputError: an unknown kind, a file too large or empty, or a recipe file that is not JSON or YAML.
        """
        if kind not in KINDS:
            raise InputError(f"unknown upload kind {kind!r}; known: {', '.join(KINDS)}")
        size = len(text.encode("utf-8"))
        if size > MAX_UPLOAD_BYTES:
            raise InputError(f"{name or 'the file'} is {size / 1024:,.0f} KiB; uploads are limited to "
                             f"{MAX_UPLOAD_BYTES // 1024} KiB")
        if not text.strip():
            raise InputError(f"{name or 'the file'} is empty")
        shown = "config.json" if kind == "config" else _safe_name(name, RECIPE_SUFFIXES if kind == "recipe" else None)
        digest = hashlib.sha256(f"{kind}\0{shown}\0{text}".encode()).hexdigest()[:16]
        with self._lock:
            if digest in self._uploads:
                self._uploads.move_to_end(digest)
                return self._uploads[digest]
            folder = self.root / digest
            folder.mkdir(exist_ok=True)
            path = folder / shown
            path.write_text(text, encoding="utf-8")
            upload = Upload(id=digest, kind=kind, name=shown, path=path)  # type: ignore[arg-type]
            self._uploads[digest] = upload
            while len(self._uploads) > MAX_UPLOADS:
                _, old = self._uploads.popitem(last=False)
                shutil.rmtree(old.path.parent, ignore_errors=True)
            return upload

    def find(self, upload_id: str) -> Upload | None:
        with self._lock:
            return self._uploads.get(upload_id)

    def get(self, upload_id: str, kind: str) -> Upload:
        """The upload a link names.

        Raises:
            InputError: no such upload of that kind here (the server restarted, or forgot the oldest).
        """
        upload = self.find(upload_id)
        if upload is None or upload.kind != kind:
            raise InputError(f"the {WHAT.get(kind, 'file')} this link names is not on this server any more (it "
                             f"restarted or forgot it): upload it again")
        return upload

    def forget(self, upload_id: str) -> None:
        with self._lock:
            upload = self._uploads.pop(upload_id, None)
        if upload is not None:
            shutil.rmtree(upload.path.parent, ignore_errors=True)

    def shown(self, message: str) -> str:
        """`message` with the server's folders taken out of the paths it names."""
        return re.sub(re.escape(str(self.root)) + r"/[0-9a-f]{16}/", "", message)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _safe_name(name: str, suffixes: tuple[str, ...] | None) -> str:
    """The base name of an uploaded file, letters, digits, `._-` only; with one of `suffixes` where given (a
    recipe file is JSON or YAML)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name or "upload.txt").name).lstrip(".") or "upload.txt"
    if suffixes and not base.lower().endswith(suffixes):
        raise InputError(f"{base}: a recipe file is JSON or YAML (.json, .yaml, .yml)")
    return base[-100:]
