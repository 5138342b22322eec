"""anatomist's folder in the user cache, and how files are written there.

`$ANATOMIST_CACHE_DIR`, else the platform's user cache (`platformdirs.user_cache_dir("anatomist")`).
It holds the trace cache (`traces/`), TrainingArguments' defaults per transformers version
(`trainer-defaults/`) and measured time calibrations (`calibration/`). Everything there can be
deleted: it is made again when needed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """$ANATOMIST_CACHE_DIR, else the platform's user cache folder for anatomist (read at each call)."""
    root = os.environ.get("ANATOMIST_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("anatomist", appauthor=False)
    return Path(root)


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file renamed into place: two processes writing the
    same file both leave a whole one, and a reader never sees half a file.

    Raises:
        OSError: the folder cannot be made or written (the caller decides whether that matters).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
