"""Where a bench keeps its checkpoints and run directories: ``--work-dir`` if given, else a temporary one.

A directory the user names is kept (a later run with the same ``--work-dir`` reuses its warm-up);
a temporary one is removed when the bench's process exits, whether it succeeded or not.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def work_directory(given: str | None, prefix: str) -> Path:
    """``given`` as a path, or a new directory under the system's temporary directory removed at exit."""
    if given:
        return Path(given)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
