"""One SGLang server process: start it with the flags megarl needs, wait for health, watch, stop.

The server runs as ``python -m megarl.engine_process.sglang_main`` (SGLang's own launch_server behind
megarl's CPU compatibility layer) in a process group of its own, so ``stop()`` reaches its
scheduler and detokenizer children too and leaves no orphans.
"""
from __future__ import annotations

import getpass
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import psutil

from megarl.engines.shared_memory import SHARED_MEMORY, mapped_segments, unlink_unmapped
from megarl.engines.types import ServedModel
from megarl.log import rotate_log
from megarl.models.lora import ENGINE_ADAPTER_SLOTS, LoraConfig
from megarl.parallel import free_port, rendezvous_host
from megarl.parallel.nccl import pin_nccl_environment
from megarl.wire.launch import API_KEY_ENV, SKIP_TOKENIZER_FLAG

log = logging.getLogger(__name__)
SCRATCH_PREFIX = "megarl-sglang-"  # a running server's TMPDIR, under the system's temporary directory
HEALTH_PROBE_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"  # SGLang's: /health generates a token first
HEALTH_POLL_S = 0.1  # start()'s interval between /health requests
SERVER_MODULE = "megarl.engine_process.sglang_main"  # SGLang's launch_server behind megarl's CPU compatibility layer


class EngineStartError(RuntimeError):
    """The server died or did not become healthy in time; the message holds its log tail."""


class EngineDiedError(RuntimeError):
    """The server process exited while it was expected to run."""


@dataclass(frozen=True)
class EngineSettings:
    """How to launch one SGLang server.

    host None binds the loopback address, or this node's routable address when the Ray cluster
    has more than one node (:func:`megarl.parallel.rendezvous_host`, resolved where the server
    starts). port None picks a free port on ``host``. ``api_key``: the bearer token every request
    but ``/health`` must carry (SGLang's ``--api-key``; kept out of the repr and off every command
    line: the server gets it in its environment, see ``API_KEY_ENV``). device None means
    "cpu" when no GPU is present, else "cuda". log_path None writes the server log to a temporary
    file (see ``SGLangEngine.log_path``).

    Parallelism (SGLang's rules, checked here): the engine runs ``tp`` ranks; ``ep`` of them split
    the routed experts (``ep`` divides ``tp`` and the expert count; each expert is split over
    ``tp / ep`` ranks); ``dp_attention`` runs attention data parallel with one attention replica
    per rank (SGLang's ``--attn-dp-size tp``, formerly ``--enable-dp-attention --dp-size tp``),
    which needs ``tp`` > 1 and a GPU (see ``SGLangEngine``). An engine spanning ``nnodes`` nodes
    is started once on each node, with its ``node_rank`` and the same ``dist_init_addr``
    ("host:port" of node 0); its ``tp`` ranks are split evenly over the nodes.
    """

    model_path: str
    host: str | None = None
    port: int | None = None
    device: str | None = None
    dtype: str = "auto"
    weight_version: int = 0
    sampling_mask_max_tokens: int = 64  # the largest top_k a request may ask a sampling mask for
    max_total_tokens: int | None = None  # KV-cache capacity in tokens; None lets SGLang size it
    # the share of the device's free memory for weights and KV cache (--mem-fraction-static); None: SGLang's guess
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    prefix_cache: bool = True  # SGLang's radix cache of computed prefixes; False: --disable-radix-cache
    # the client's side: a prompt of at least this many tokens sent more than once in a batch is prefilled
    # once before it (SGLangClient._prefill_shared); 0: off, as it is without the prefix cache
    shared_prefill_min_tokens: int = 0
    # the client's side: sampling masks come with the engine's log-prob of every kept id (score centering)
    support_logprobs: bool = False
    # False: --skip-tokenizer-init, for engines that only get token ids and no stop strings or grammar
    # (the scheduler sends its output to the HTTP process directly, without the detokenizer's hop);
    # responses still end at the tokenizer's EOS (megarl.engine_process.tokenizer_stops)
    tokenizer: bool = True
    random_seed: int = 0
    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of node 0; required when nnodes > 1
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    log_path: str | None = None
    lora_max_rank: int = 0  # > 0: serve LoRA adapters up to this rank (SGLang --enable-lora)
    lora_target_modules: tuple[str, ...] = ()  # the HF module names adapters may target (--lora-target-modules)
    # GPU only (megarl.engines.launch_plan): SGLang's --attention-backend, its first GPU (--base-gpu-id, counted
    # within the GPUs the server sees; None: SGLang's 0) and --enable-memory-saver (a colocated engine's release)
    attention_backend: str | None = None
    base_gpu_id: int | None = None
    memory_saver: bool = False
    # GPU only: the node's GPU ids this node's ranks run on, in rank order, as the server's CUDA_VISIBLE_DEVICES
    # (a colocated engine's, pinned beside its trainer ranks: megarl.engines.pinning); (): the process's own
    visible_gpus: tuple[str, ...] = ()
    server_module: str = SERVER_MODULE  # the module run as the server (python -m); a stand-in in the rehearsal
    extra_args: tuple[str, ...] = ()  # more launch_server flags, appended as given
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.sampling_mask_max_tokens < 1:
            raise ValueError(f"sampling_mask_max_tokens must be >= 1, got {self.sampling_mask_max_tokens}")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"model_path {self.model_path!r} has no config.json")
        self._check_parallelism()
        if self.visible_gpus and len(self.visible_gpus) != self.ranks_per_node:
            raise ValueError(f"visible_gpus names {len(self.visible_gpus)} GPUs for the {self.ranks_per_node} ranks "
                             f"this node runs: {self.visible_gpus}")
        if self.lora_max_rank < 0 or bool(self.lora_max_rank) != bool(self.lora_target_modules):
            raise ValueError("LoRA serving needs lora_max_rank > 0 and lora_target_modules together, got "
                             f"{self.lora_max_rank} and {self.lora_target_modules}")

    @property
    def attention_tp(self) -> int:
        """Ranks one attention layer is split over: ``tp``, or 1 with DP attention."""
        return 1 if self.dp_attention else self.tp

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    def _check_parallelism(self) -> None:
        from megarl.models.hf_config import read_hf_config

        if self.tp < 1 or self.ep < 1:
            raise ValueError(f"tp and ep must be >= 1, got tp={self.tp} ep={self.ep}")
        if self.tp % self.ep:
            raise ValueError(f"ep={self.ep} must divide tp={self.tp}: SGLang's expert-parallel ranks are "
                             f"tensor-parallel ranks (each expert is split over tp/ep ranks)")
        if self.dp_attention and self.tp == 1:
            raise ValueError("dp_attention needs tp > 1 (one attention replica per rank)")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got nnodes={self.nnodes} "
                             f"node_rank={self.node_rank}")
        if self.tp % self.nnodes:
            raise ValueError(f"tp={self.tp} ranks do not split evenly over nnodes={self.nnodes}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        hf = read_hf_config(self.model_path)
        if hf.num_experts and hf.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide the model's {hf.num_experts} experts")
        moe_tp = self.tp // self.ep
        if hf.num_experts and hf.moe_ffn_hidden_size and hf.moe_ffn_hidden_size % moe_tp:
            raise ValueError(f"each expert is split over tp/ep={moe_tp} ranks, which must divide its "
                             f"FFN size {hf.moe_ffn_hidden_size}")
        if hf.num_attention_heads and hf.num_attention_heads % self.attention_tp:
            raise ValueError(f"attention is split over {self.attention_tp} ranks, which must divide the "
                             f"{hf.num_attention_heads} attention heads")
        kv = hf.num_query_groups
        if kv and kv % self.attention_tp and self.attention_tp % kv:
            raise ValueError(f"attention is split over {self.attention_tp} ranks: that and the {kv} KV heads "
                             "must divide one another")


def _sglang_cpu():
    """megarl's SGLang CPU layer, imported where it is needed: it imports torch, which a GPU engine's owner
    (its server has its own) does without."""
    from megarl.platform import sglang_cpu

    return sglang_cpu


def nodes_of(tp: int, gpus_per_node: int) -> int:
    """The nodes an engine of ``tp`` ranks spans: 1 when it fits in a node of ``gpus_per_node`` devices,
    else ``tp / gpus_per_node`` (whole nodes; the config refuses a ``tp`` neither dividing nor divided
    by ``gpus_per_node``)."""
    return max(1, tp // gpus_per_node)


def lora_serving(lora: LoraConfig | None) -> dict:
    """The EngineSettings fields that serve ``lora``'s adapters: none for full weights or a merged sync."""
    if lora is None or lora.sync != "adapter":
        return {}
    return {"lora_max_rank": lora.rank, "lora_target_modules": tuple(lora.hf_target_modules)}


class SGLangEngine:
    """Owns one SGLang server process. ``start()`` blocks until ``/health`` answers 200."""

    def __init__(self, settings: EngineSettings):
        if settings.host is None:
            settings = replace(settings, host=rendezvous_host())
        self.settings = settings
        self.model = ServedModel.from_hf_config(settings.model_path)
        self.device = settings.device or ("cpu" if _sglang_cpu().needed() else "cuda")
        if settings.nnodes > 1 and not settings.dist_init_addr:
            raise ValueError(f"an engine on nnodes={settings.nnodes} needs dist_init_addr (host:port of node 0; "
                             "EngineActor sets it when it starts the engine's nodes)")
        if settings.dp_attention and self.device == "cpu":
            # SGLang 0.5.23 pads DP-attention batches through an attention-backend method that its
            # CPU (torch_native) backend lacks: AttributeError 'get_cpu_graph_seq_len_fill_value'.
            raise ValueError("dp_attention does not run on SGLang's CPU path; use tp/ep without it on CPU")
        self.port = settings.port or free_port(settings.host)
        self._log_path = Path(settings.log_path) if settings.log_path else None
        self._process: subprocess.Popen | None = None
        self._scratch: str | None = None  # the server's TMPDIR while it runs (see environment())
        self._cancelled = threading.Event()  # set by cancel_start() from another thread
        self.startup_s: float | None = None  # seconds from spawn to healthy, set by start()

    @property
    def log_path(self) -> Path:
        """The server's log: ``settings.log_path``, else a temporary file made on first use (an engine
        that is never started leaves none behind)."""
        if self._log_path is None:
            self._log_path = Path(_temporary_log_path())
        return self._log_path

    @property
    def pid(self) -> int | None:
        """The server's process id (it leads its own process group); None before start/after stop."""
        return self._process.pid if self._process is not None else None

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line (without the API key: see :meth:`environment`)."""
        s = self.settings
        cmd = [
            sys.executable, "-m", s.server_module,
            "--model-path", s.model_path, "--host", s.host, "--port", str(self.port), "--device", self.device,
            "--dtype", s.dtype, "--random-seed", str(s.random_seed), "--weight-version", str(s.weight_version),
            "--enable-return-routed-experts", "--sampling-mask-max-tokens", str(s.sampling_mask_max_tokens),
            "--skip-server-warmup", "--log-level", "warning",
            # an idle scheduler otherwise polls its sockets in a busy loop, a whole core taken from the trainer
            # and the other engines, and so does a paused one (megarl.engine_process.paused_wait): a weight
            # sync's window, a colocated training step; with it, it waits on them (a request wakes it at once)
            "--sleep-on-idle",
            # a request's priority (SamplingParams.priority) orders the queue: held-out evaluations go before the
            # training stream's queued requests; none preempts a running one (the threshold's default, 10, would
            # let only far higher ones; off outright, no request's computed tokens are thrown away for another)
            "--enable-priority-scheduling", "--default-priority-value", "0", "--disable-priority-preemption",
        ]
        if self.device == "cpu":
            # --disable-overlap-schedule: overlapping the next batch's scheduling with the forward pays on a
            # GPU; on CPU both take the same cores, and the overlap's bookkeeping slows the rollout down.
            cmd += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                    "--disable-overlap-schedule"]
        else:
            cmd += self._gpu_args()
        if s.lora_max_rank:
            cmd += ["--enable-lora", "--max-lora-rank", str(s.lora_max_rank),
                    "--lora-target-modules", *s.lora_target_modules,
                    "--max-loras-per-batch", str(ENGINE_ADAPTER_SLOTS)]
            if self.device == "cpu":  # SGLang's default LoRA kernels are Triton's
                cmd += ["--lora-backend", "torch_native"]
        if s.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(s.max_total_tokens)]
        if s.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(s.mem_fraction_static)]
        if s.max_running_requests is not None:
            cmd += ["--max-running-requests", str(s.max_running_requests)]
        if not s.prefix_cache:
            cmd.append("--disable-radix-cache")
        if not s.tokenizer:
            cmd.append(SKIP_TOKENIZER_FLAG)
        if s.tp > 1:
            cmd += ["--tp-size", str(s.tp)]
        if s.ep > 1:
            cmd += ["--ep-size", str(s.ep)]
        if s.dp_attention:
            cmd += ["--attn-dp-size", str(s.tp)]
        if s.nnodes > 1:
            cmd += ["--nnodes", str(s.nnodes), "--node-rank", str(s.node_rank), "--dist-init-addr", s.dist_init_addr]
        return cmd + list(s.extra_args)

    def _gpu_args(self) -> list[str]:
        """The GPU flags of :class:`EngineSettings` (see :mod:`megarl.engines.launch_plan`)."""
        s, args = self.settings, []
        if s.attention_backend is not None:
            args += ["--attention-backend", s.attention_backend]
        if s.base_gpu_id is not None:
            args += ["--base-gpu-id", str(s.base_gpu_id)]
        if s.memory_saver:
            args.append("--enable-memory-saver")
        return args

    def environment(self) -> dict[str, str]:
        """The server's environment: this process's, with ``TMPDIR`` a directory of the server's own
        once started, plus on CPU the ranks it starts on this node (megarl's SGLang CPU layer binds
        each its cores, see ``sglang_cpu``), on GPU the pinned GPUs (``visible_gpus``) as its
        ``CUDA_VISIBLE_DEVICES``, the NCCL settings every process of the run shares
        (:mod:`megarl.parallel.nccl`), the API key in ``API_KEY_ENV`` when there is one, and
        ``HEALTH_PROBE_ENV`` off unless this process sets it."""
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        pin_nccl_environment(env)
        if self.settings.visible_gpus and self.device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.settings.visible_gpus)
        # /health answers once the server is up (start() polls it), without generating a probe token
        # first: SGLang's probe waits a whole second before it looks for the token, at every start.
        env.setdefault(HEALTH_PROBE_ENV, "0")
        if self.settings.api_key:
            env[API_KEY_ENV] = self.settings.api_key
        if self._scratch is not None:
            # SGLang names its ZMQ sockets with NamedTemporaryFile(delete=False) and never removes them
            # (five or more files a start); multiprocessing leaves pymp-* directories: all go in a
            # directory of this server's, removed by stop() (or, after a SIGKILL, by the next start on
            # this machine: remove_orphaned_scratch). TorchInductor's cache stays where it was.
            inductor_cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
            env["TMPDIR"] = self._scratch
        if self.settings.nnodes > 1:
            # The engine's nodes meet on the address it serves at (its node's, from Ray): SGLang otherwise
            # guesses one from the interfaces (the ranks' broadcast queue binds there), which on a node
            # of several interfaces, or none with a default route, need not be one the others reach.
            env.setdefault("SGLANG_HOST_IP", self.settings.host)
        if self.device == "cpu":
            # A CPU engine on a machine with GPUs: SGLang's processes must not see them, or they take
            # their CUDA paths and megarl's CPU layer stays off (it acts only where no GPU is usable).
            env["CUDA_VISIBLE_DEVICES"] = ""
            sglang_cpu = _sglang_cpu()
            env[sglang_cpu.RANKS_PER_NODE_ENV] = str(self.settings.ranks_per_node)
            env[sglang_cpu.RANKS_ENV] = str(self.settings.tp)
            # A server whose scheduler ends (a crash, or stop()'s SIGTERM) otherwise sleeps 5 s, tries
            # py-spy and a CUDA core dump of the schedulers still alive and waits up to 60 s for the dump
            # before it exits: CUDA diagnostics that do not exist on CPU. Its own errors come first.
            for name in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
                env.setdefault(name, "0")
        return env

    def start(self) -> None:
        """Spawn the server and wait for health; raises EngineStartError (server stopped) on failure
        or when :meth:`cancel_start` was called."""
        if self._process is not None:
            raise RuntimeError(f"engine at {self.url} already started")
        t0 = time.monotonic()
        remove_orphaned_scratch()
        self._scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
        rotate_log(self.log_path)
        with open(self.log_path, "ab") as log_file:
            self._process = subprocess.Popen(
                self.command(), env=self.environment(), stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        (Path(self._scratch) / "server.pid").write_text(str(self._process.pid))
        log.info("SGLang server pid %d starting at %s (log %s)", self._process.pid, self.url, self.log_path)
        try:
            self._wait_healthy(t0 + self.settings.startup_timeout_s)
            if self.settings.node_rank == 0:  # another node of the engine serves only /health (SGLang's stand-in)
                self._freeze_gc()
            _record_segments(self._process.pid, Path(self._scratch))
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
                if self._cancelled.is_set():
                    raise EngineStartError(f"SGLang server start at {self.url} cancelled (the engine was stopped)")
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
                self._cancelled.wait(HEALTH_POLL_S)

    def cancel_start(self) -> None:
        """Make a :meth:`start` under way in another thread give up within half a second: it stops
        the server and raises EngineStartError (a start begun later gives up at once). Loading a big
        checkpoint takes minutes, and a run that fails or is interrupted meanwhile should not wait
        for it. Thread-safe; a server already healthy is not affected (:meth:`stop` it)."""
        self._cancelled.set()

    def _freeze_gc(self) -> None:
        """Take what the server's processes hold after start-up (imported modules, the model) out of
        Python's garbage collection (SGLang's ``/freeze_gc``, in the tokenizer, scheduler and
        detokenizer). Without it a full collection over that graph stalls them every few steps of
        a rollout."""
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        response = httpx.post(self.url + "/freeze_gc", headers=headers, timeout=30.0)
        if response.status_code != 200:
            raise EngineStartError(f"SGLang server at {self.url} refused /freeze_gc ({response.status_code}): "
                                   f"{response.text[:200]}")

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

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
        if self._scratch is not None:
            _remove_scratch(Path(self._scratch))
            self._scratch = None
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


def remove_orphaned_scratch() -> None:
    """Remove what this machine's servers that are gone without their stop() (killed with their owner:
    Ray SIGKILLs a dead actor's children) left: their temporary directories, and the shared-memory
    segments SGLang names after their creating process (``sgl_shm_<kind>_<pid>_<random>``, 24 MiB for
    each message queue of a TP engine; the naming of SGLang's ``stale_shm_cleanup``) once that process
    is gone and nothing maps them. A directory whose server still runs, or whose server is being
    started (no pid written yet), stays."""
    for path in Path(tempfile.gettempdir()).glob(SCRATCH_PREFIX + "*"):
        try:
            pid = int((path / "server.pid").read_text())
        except (OSError, ValueError):
            continue
        if not psutil.pid_exists(pid):
            _remove_scratch(path)
    if SHARED_MEMORY.is_dir():
        stamped = {p.name: p.name.split("_")[-2] for p in SHARED_MEMORY.glob("sgl_shm_*_*_*")}
        orphans = [name for name, pid in stamped.items() if pid.isdigit() and not psutil.pid_exists(int(pid))]
        if orphans:
            unlink_unmapped(orphans, mapped_segments())


SEGMENTS_FILE = "segments"  # in a server's scratch directory: the /dev/shm names its processes mapped when healthy


def _record_segments(pgid: int, scratch: Path) -> None:
    """Note the ``/dev/shm`` files the server's processes (its process group) map once it is healthy
    (SGLang's ``sglang_loads_*`` slot file, its message queues): a SIGKILL skips SGLang's unlink."""
    group = [pid for pid in psutil.pids() if _group_of(pid) == pgid]
    (scratch / SEGMENTS_FILE).write_text("".join(f"{name}\n" for name in sorted(mapped_segments(group))))


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _remove_scratch(scratch: Path) -> None:
    """Remove a stopped (or gone) server's scratch directory and the segments it noted that nothing maps."""
    segments = scratch / SEGMENTS_FILE
    if segments.is_file():
        unlink_unmapped(segments.read_text().split(), mapped_segments())
    shutil.rmtree(scratch, ignore_errors=True)


def _temporary_log_path() -> str:
    fd, path = tempfile.mkstemp(prefix="sglang-", suffix=".log")
    os.close(fd)
    return path


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
