"""Process-wide logging set-up: megarl at INFO, the libraries' import chatter at WARNING; the rotation of the
log files megarl's servers write (:func:`rotate_log`)."""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

QUIET = ("megatron", "transformers", "torch.distributed", "ray", "hydra", "sglang", "httpx")


class _LibraryChatter(logging.Filter):
    """Drops records below WARNING from the QUIET libraries, whatever level they set themselves
    (megatron-bridge's import_utils sets INFO and adds its own handler at import time)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(QUIET)


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once per process (``MEGARL_LOG_LEVEL`` overrides ``level``)."""
    level = os.environ.get("MEGARL_LOG_LEVEL", level or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if level == "DEBUG":
        return
    chatter = _LibraryChatter()
    for handler in logging.getLogger().handlers:
        handler.addFilter(chatter)
    logging.getLogger("megatron.bridge.utils.import_utils").addFilter(chatter)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


LOG_ROTATE_BYTES = 64 << 20  # a server log larger than this is rotated when its server (re)starts
LOG_BACKUPS = 2  # rotated copies kept: <log>.1 (the newest) .. <log>.<LOG_BACKUPS>


def rotate_log(path: str | Path, max_bytes: int = LOG_ROTATE_BYTES, backups: int = LOG_BACKUPS) -> bool:
    """Before a process starts appending to ``path``: when the file has more than ``max_bytes``, shift
    ``path.1`` .. ``path.<backups - 1>`` up by one (the oldest dropped) and move ``path`` to ``path.1``.
    Whether it rotated. The disk a log takes is then at most about ``(backups + 1) * max_bytes`` plus what
    one server writes between its starts."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size <= max_bytes:
        return False
    for n in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            older.replace(path.with_name(f"{path.name}.{n + 1}"))
    path.replace(path.with_name(f"{path.name}.1"))
    return True
