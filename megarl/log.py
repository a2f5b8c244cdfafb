"""Process-wide logging set-up: megarl at INFO, the libraries' import chatter at WARNING."""
from __future__ import annotations

import logging
import os
import warnings

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
