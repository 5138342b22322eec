"""TrainingArguments' defaults as the installed transformers has them, kept on disk per version.

Recipe's defaults are TrainingArguments' own (`optim` is `adamw_torch_fused` with torch >= 2.8,
the batch 8, ...). Reading them imports transformers and torch (4-7 s); the values depend only on
the installed transformers and torch, so they are read once per pair of versions and kept in
`<user cache>/trainer-defaults/transformers-V-torch-W.json`. A recipe is then made, and a bad value
refused, without importing either.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from functools import cache
from typing import Any

from anatomist.user_cache import cache_root, write_atomically

JSON_TYPES = (str, int, float, bool, type(None))


def versions_key() -> str:
    """The installed transformers and torch versions, as the defaults' file names them (read from the
    packages' metadata: no import)."""
    return f"transformers-{importlib.metadata.version('transformers')}-torch-{importlib.metadata.version('torch')}"


@cache
def trainer_defaults() -> dict[str, Any]:
    """The installed transformers' TrainingArguments defaults, by field name (those with a JSON value).

    From the file of this transformers and torch, else from TrainingArguments itself (then written
    to that file; a cache folder that cannot be written is no error: the defaults are read again
    next time)."""
    path = cache_root() / "trainer-defaults" / f"{versions_key()}.json"
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict):
            return kept
    except (OSError, ValueError):
        pass  # missing or damaged: read them again
    defaults = _read_from_transformers()
    try:
        write_atomically(path, json.dumps(defaults, indent=0, sort_keys=True).encode())
    except OSError:
        pass
    return defaults


def _read_from_transformers() -> dict[str, Any]:
    from transformers import TrainingArguments

    return {f.name: f.default for f in dataclasses.fields(TrainingArguments)
            if f.default is not dataclasses.MISSING and isinstance(f.default, JSON_TYPES)}
