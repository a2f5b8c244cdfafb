"""One SGLang server process: start it with the flags megarl needs, wait for health, watch, stop.

The server runs as ``python -m megarl.engines.sglang_main`` (SGLang's own launch_server behind
megarl's CPU compatibility layer) in a process group of its own, so ``stop()`` reaches its
scheduler and detokenizer children too and leaves no orphans.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from megarl.platform import sglang_cpu
from megarl.engines.client import ServedModel

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The server died or did not become healthy in time; the message holds its log tail."""


class EngineDiedError(RuntimeError):
    """The server process exited while it was expected to run."""


@dataclass(frozen=True)
class EngineSettings:
    """How to launch one SGLang server.

    port None picks a free port on ``host``. device None means "cpu" when no GPU is present,
    else "cuda". log_path None writes the server log to a temporary file (see ``SGLangEngine.log_path``).
    """

    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None
    device: str | None = None
    dtype: str = "auto"
    weight_version: int = 0
    sampling_mask_max_tokens: int = 64  # the largest top_k a request may ask a sampling mask for
    max_total_tokens: int | None = None  # KV-cache capacity in tokens; None lets SGLang size it
    max_running_requests: int | None = None
    random_seed: int = 0
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    log_path: str | None = None
    extra_args: tuple[str, ...] = ()  # more launch_server flags, appended as given

    def __post_init__(self):
        if self.sampling_mask_max_tokens < 1:
            raise ValueError(f"sampling_mask_max_tokens must be >= 1, got {self.sampling_mask_max_tokens}")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path {self.model_path!r} has no config.json")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangEngine:
    """Owns one SGLang server process. ``start()`` blocks until ``/health`` answers 200."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.model = ServedModel.from_hf_config(settings.model_path)
        self.device = settings.device or ("cpu" if sglang_cpu.needed() else "cuda")
        self.port = settings.port or free_port(settings.host)
        self.log_path = Path(settings.log_path or _temporary_log_path())
        self._process: subprocess.Popen | None = None
        self.startup_s: float | None = None  # seconds from spawn to healthy, set by start()

    @property
    def pid(self) -> int | None:
        """The server's process id (it leads its own process group); None before start/after stop."""
        return self._process.pid if self._process is not None else None

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        s = self.settings
        cmd = [
            sys.executable, "-m", "megarl.engines.sglang_main",
            "--model-path", s.model_path, "--host", s.host, "--port", str(self.port), "--device", self.device,
            "--dtype", s.dtype, "--random-seed", str(s.random_seed), "--weight-version", str(s.weight_version),
            "--enable-return-routed-experts", "--sampling-mask-max-tokens", str(s.sampling_mask_max_tokens),
            "--skip-server-warmup", "--log-level", "warning",
        ]
        if self.device == "cpu":
            cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph"]
        if s.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(s.max_total_tokens)]
        if s.max_running_requests is not None:
            cmd += ["--max-running-requests", str(s.max_running_requests)]
        return cmd + list(s.extra_args)

    def start(self) -> None:
        """Spawn the server and wait for health; raises EngineStartError (server stopped) on failure."""
        if self._process is not None:
            raise RuntimeError(f"engine at {self.url} already started")
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                self.command(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        log.info("SGLang server pid %d starting at %s (log %s)", self._process.pid, self.url, self.log_path)
        try:
            self._wait_healthy(t0 + self.settings.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        log.info("SGLang server at %s healthy after %.1f s", self.url, self.startup_s)

    def _wait_healthy(self, deadline: float) -> None:
        with httpx.Client(timeout=5.0) as http:
            while True:
                if self._process.poll() is not None:
                    raise EngineStartError(
                        f"SGLang server exited with code {self._process.returncode} during start-up; "
                        f"log tail ({self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineStartError(
                        f"SGLang server not healthy after {self.settings.startup_timeout_s:.0f} s; "
                        f"log tail ({self.log_path}):\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def check_alive(self) -> None:
        """Raise EngineDiedError (with the log tail) when the server process has exited."""
        if self._process is None:
            raise EngineDiedError("engine not started")
        if self._process.poll() is not None:
            raise EngineDiedError(
                f"SGLang server pid {self._process.pid} exited with code {self._process.returncode}; "
                f"log tail ({self.log_path}):\n{self.log_tail()}"
            )

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL whatever is left after ``stop_timeout_s``."""
        process, self._process = self._process, None
        if process is None:
            return
        pgid = process.pid  # start_new_session=True: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        try:
            process.wait(self.settings.stop_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("SGLang server pid %d ignored SIGTERM for %.0f s; killing", pgid, self.settings.stop_timeout_s)
        _signal_group(pgid, signal.SIGKILL)  # children that outlived the leader
        process.wait()
        log.info("SGLang server pid %d stopped", pgid)

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> SGLangEngine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _temporary_log_path() -> str:
    fd, path = tempfile.mkstemp(prefix="sglang-", suffix=".log")
    os.close(fd)
    return path


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
