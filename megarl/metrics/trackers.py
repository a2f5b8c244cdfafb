"""Experiment trackers a run's metrics go to besides ``metrics.jsonl``: TensorBoard (the default),
Weights & Biases and MLflow (``logging.trackers``; their settings ``logging.wandb`` / ``logging.mlflow``).

Each tracker gets every row :class:`megarl.metrics.sink.MetricsFile` writes, at the row's step, its
finite values only (``metrics.jsonl`` has ``null`` where a value is not finite). wandb and MLflow are
optional dependencies, pinned in ``requirements.lock``: :func:`missing_tracker` names the install step
of one a config asks for but that is not installed (the driver refuses such a config at load). A
tracker that raises is logged, and left out of the rest of the run when it fails to start or fails
:data:`MAX_FAILURES` rows in a row; training goes on (:class:`Trackers`).

- ``wandb``: one run per run directory (its id kept in ``run_dir/wandb_run_id``, so a resumed run logs
  into the same wandb run; offline, into a second run directory of that id), ``online`` or ``offline``
  (the run's files under ``run_dir/wandb``, sent later with ``wandb sync``); project, name, tags, group
  and entity from ``logging.wandb``; the resolved config as the run's config.
- ``mlflow``: one MLflow run in the experiment ``logging.mlflow.experiment`` at
  ``logging.mlflow.tracking_uri`` (default: a file store at ``run_dir/mlruns``, MLflow's
  ``MLFLOW_ALLOW_FILE_STORE`` opt-in set for it); the resolved config, flattened to dotted keys, as
  the run's params. MLflow's metric names take letters, digits and ``_ - . / : space`` only: any other
  character becomes ``_at_`` for ``@`` (``eval/pass@4`` -> ``eval/pass_at_4``) and ``_`` otherwise
  (:func:`mlflow_metric_name`).
"""
from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from megarl.fields import setting

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")  # logging.trackers' names
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it imports
# tracker -> what installs it: the lock pins it, tools/setup_venv.sh installs the lock
INSTALL = {"wandb": "wandb==0.29.0", "mlflow": "mlflow-skinny==3.18.0"}
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param's value
MAX_FAILURES = 3  # a tracker whose log raises this many times in a row is dropped


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (``logging.trackers`` naming ``wandb``)."""

    project: str = "megarl"
    name: Optional[str] = None  # the wandb run's name; None = run_name
    entity: Optional[str] = None  # the team or user; None = the logged-in user's default
    group: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # online (needs a login: wandb login, or WANDB_API_KEY) | offline (files under run_dir/wandb; wandb sync)
    mode: str = setting("online", choices=("online", "offline"))


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow (``logging.trackers`` naming ``mlflow``)."""

    tracking_uri: Optional[str] = None  # any MLflow tracking URI; None = a file store at run_dir/mlruns
    experiment: Optional[str] = None  # None = run_name
    run_name: Optional[str] = None  # None = run_name


class Tracker(Protocol):
    """One tracker: ``log`` a row of finite values at a step, ``close`` at the run's end."""

    def log(self, step: int, values: Mapping[str, float], wall_time: float) -> None: ...

    def close(self) -> None: ...


def missing_tracker(names: Sequence[str]) -> str | None:
    """The first of the tracker ``names`` whose package is not installed, as one line naming the
    install step; None when all are."""
    for name in names:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            return (f"{name} is not installed: run tools/setup_venv.sh (requirements.lock pins it) or "
                    f"pip install --no-deps {INSTALL[name]} and the lock's pins of its dependencies")
    return None


def finite(values: Mapping[str, float]) -> dict[str, float]:
    """``values`` as floats, the non-finite ones left out."""
    out = {}
    for key, value in values.items():
        number = float(value)
        if math.isfinite(number):
            out[key] = number
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"rollout.top_k": "20", ...}`` (lists as their repr), for MLflow's params."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)[:MAX_PARAM_CHARS]
    return out


def mlflow_metric_name(key: str) -> str:
    """``key`` as MLflow accepts a metric name (module docstring)."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


class TensorBoardTracker:
    """:class:`megarl.metrics.tensorboard.TensorBoardScalars` under ``run_dir/tensorboard``."""

    def __init__(self, run_dir: Path):
        from megarl.metrics.tensorboard import TensorBoardScalars

        self._scalars = TensorBoardScalars(run_dir)

    def log(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._scalars.log(step, values, wall_time=wall_time)

    def close(self) -> None:
        self._scalars.close()


class WandbTracker:
    """One wandb run for ``run_dir`` (module docstring); ``config``: the run's resolved config."""

    def __init__(self, settings: WandbConfig, run_dir: Path, run_name: str, config: Mapping[str, Any]):
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None  # None: wandb draws one
        self._run = wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_name,
                               group=settings.group, tags=list(settings.tags), mode=settings.mode, dir=str(run_dir),
                               config=dict(config), id=run_id, resume="allow" if settings.mode == "online" else None,
                               settings=wandb.Settings(console="off", disable_git=True, x_disable_stats=True,
                                                       silent=True))
        id_file.write_text(self._run.id)

    def log(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """One MLflow run (module docstring); ``config``: the run's resolved config, logged as params."""

    def __init__(self, settings: MlflowConfig, run_dir: Path, run_name: str, config: Mapping[str, Any]):
        uri = settings.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks file stores to opt in
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        experiment = settings.experiment or run_name
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
        self.run_id = client.create_run(experiment_id, run_name=settings.run_name or run_name).info.run_id
        params = [Param(k, v) for k, v in flat_config(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(self.run_id, params=params[start:start + 100])
        self.tracking_uri = uri

    def log(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        from mlflow.entities import Metric

        stamp = int(wall_time * 1000)
        metrics = [Metric(mlflow_metric_name(k), v, stamp, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit on metrics
            self._client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


@dataclass
class TrackerSettings:
    """What the trackers of a run need: ``names`` (``logging.trackers``), their sections, the run's
    name and resolved config (a plain nested dict)."""

    names: Sequence[str] = ("tensorboard",)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    run_name: str = "run"
    config: Mapping[str, Any] = field(default_factory=dict)


def start_tracker(name: str, settings: TrackerSettings, run_dir: Path) -> Tracker:
    """The tracker ``name`` (one of :data:`TRACKERS`) for the run in ``run_dir``."""
    if name == "tensorboard":
        return TensorBoardTracker(run_dir)
    if name == "wandb":
        return WandbTracker(settings.wandb, run_dir, settings.run_name, settings.config)
    if name == "mlflow":
        return MlflowTracker(settings.mlflow, run_dir, settings.run_name, settings.config)
    raise ValueError(f"logging.trackers: {name!r} is not one of {', '.join(TRACKERS)}")


class Trackers:
    """The run's trackers. One that raises is logged (with the traceback of its first failure) and
    dropped when it fails to start or to close, or to log :data:`MAX_FAILURES` rows in a row; the others
    and the run go on. ``failed``: tracker name -> its last error."""

    def __init__(self, settings: TrackerSettings, run_dir: str | Path):
        self._trackers: dict[str, Tracker] = {}
        self.failed: dict[str, str] = {}
        self._failures: dict[str, int] = {}
        for name in dict.fromkeys(settings.names):
            try:
                self._trackers[name] = start_tracker(name, settings, Path(run_dir))
            except Exception as exc:  # noqa: BLE001 -- a tracker's failure never stops the run
                self._failed(name, "start", exc, drop=True)

    @property
    def names(self) -> list[str]:
        """The trackers still logging."""
        return list(self._trackers)

    def _failed(self, name: str, doing: str, exc: Exception, drop: bool) -> None:
        first = name not in self.failed
        self.failed[name] = f"{type(exc).__name__}: {exc}"
        self._failures[name] = self._failures.get(name, 0) + 1
        drop = drop or self._failures[name] >= MAX_FAILURES
        if drop:
            self._trackers.pop(name, None)
        log.error("tracker %s failed to %s (%s); the run goes on%s", name, doing, self.failed[name],
                  " without it" if drop else "", exc_info=exc if first else None)

    def log(self, step: int, values: Mapping[str, float], wall_time: float | None = None) -> None:
        """``values``' finite ones at ``step`` (``wall_time``: seconds since the epoch; now if None) to each tracker."""
        numbers, wall_time = finite(values), time.time() if wall_time is None else wall_time
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.log(step, numbers, wall_time)
                self._failures[name] = 0
            except Exception as exc:  # noqa: BLE001
                self._failed(name, f"log step {step}", exc, drop=False)

    def close(self) -> None:
        for name, tracker in list(self._trackers.items()):
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                self._failed(name, "close", exc, drop=True)
        self._trackers = {}
