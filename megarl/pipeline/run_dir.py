"""A run directory belongs to one run.

``logging.run_dir`` holds one run's checkpoints (``checkpoints/``), ``metrics.jsonl``, trained-prompt rows,
TensorBoard event files, curves, engine logs and resolved ``config.yaml``. :func:`open_run_dir` decides, before
anything starts, what a command does with the directory it is given:

- it resumes (``trainer.resume``, the default, and ``checkpoints/latest`` exists, an RL mode): the run
  continues from the step ``latest`` names, in the mode it was started in. A directory whose run was started
  in another ``mode`` is refused (:class:`ConfigError` on ``mode``); one whose run already reached ``steps`` ends
  the command at once (:class:`NothingLeftToTrain`, exit status 0). Each names the step reached and how to
  start over.
- it starts over (``trainer.resume=false``, ``mode=warmup``, or no checkpoint): whatever an earlier run left
  is moved, not deleted, to ``previous/<UTC time>/`` inside the directory, so the new run's metrics, event
  files and checkpoints are its own and a later resume cannot reach an older run's checkpoint.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from megarl.config.errors import ConfigError, fail
from megarl.trainer.checkpoint import CheckpointError, latest_step

PREVIOUS = "previous"  # earlier runs set aside, one subdirectory each
KEPT = (PREVIOUS, "mlruns")  # what a new run leaves in place: the runs set aside, MLflow's store of runs


class NothingLeftToTrain(Exception):
    """The run in the directory already reached the step count asked for; the message is one line."""


@dataclass(frozen=True)
class RunDirState:
    """What a run directory holds: the step its ``checkpoints/latest`` names and the mode its config.yaml says
    (None for either when absent)."""

    step: int | None
    mode: str | None

    @classmethod
    def read(cls, run_dir: Path) -> RunDirState:
        try:
            step = latest_step(run_dir / "checkpoints")
        except CheckpointError as exc:
            fail("logging.run_dir", f"{exc}; trainer.resume=false starts over (the old run set aside)")
        return cls(step=step, mode=_saved_mode(run_dir / "config.yaml"))


def _saved_mode(config: Path) -> str | None:
    """The ``mode`` of a run directory's config.yaml (None when it has none or cannot be read)."""
    try:
        mode = OmegaConf.load(config).get("mode")
    except Exception:  # absent, or not YAML: the directory says nothing about its mode
        return None
    return mode if isinstance(mode, str) else None


def resumes(cfg: DictConfig, state: RunDirState) -> bool:
    """Whether the command continues the run in its directory (module docstring)."""
    return cfg.mode != "warmup" and bool(cfg.trainer.resume) and state.step is not None


def open_run_dir(cfg: DictConfig, command: list[str]) -> Path:
    """The run directory, made when absent, the old run set aside when this command starts over, and the resolved
    config.yaml written; ``command`` (the driver's arguments) goes into the one-line answers. Raises ConfigError
    (a directory that cannot be made; a resume in another mode) and :class:`NothingLeftToTrain`."""
    run_dir = Path(cfg.logging.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail("logging.run_dir", f"cannot create {run_dir} ({exc.strerror or type(exc).__name__})")
    state = RunDirState.read(run_dir)
    if resumes(cfg, state):
        check_resumable(cfg, state, command)
    else:
        set_aside(run_dir)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    return run_dir


def check_resumable(cfg: DictConfig, state: RunDirState, command: list[str]) -> None:
    """A resume continues the run in the mode it started in, and only when steps are left to train."""
    run_dir = cfg.logging.run_dir
    over = f"`{start_over_command(command)}` starts over (the old run set aside under {run_dir}/{PREVIOUS}/)"
    if state.mode is not None and state.mode != cfg.mode:
        raise ConfigError(f"mode: {run_dir} holds a mode={state.mode} run at step {state.step}, which mode={cfg.mode} "
                          f"does not continue; {over}, or choose another logging.run_dir")
    if state.step >= cfg.steps:
        raise NothingLeftToTrain(f"{run_dir} already reached step {state.step} of steps={cfg.steps}: nothing left to "
                                 f"train; steps=N above {state.step} continues it, {over}")


def set_aside(run_dir: Path) -> Path | None:
    """Move what an earlier run left in ``run_dir`` (all but :data:`KEPT`) to ``run_dir/previous/<UTC time>/``;
    that directory, or None when there was nothing."""
    old = [entry for entry in sorted(run_dir.iterdir()) if entry.name not in KEPT]
    if not old:
        return None
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    aside = run_dir / PREVIOUS / stamp
    aside.mkdir(parents=True)
    for entry in old:
        entry.rename(aside / entry.name)
    return aside


def resume_command(command: list[str]) -> str:
    """The driver command that continues the run: ``command`` without any ``trainer.resume`` override."""
    kept = [arg for arg in command if not arg.lstrip("+~").startswith("trainer.resume=")]
    return shlex.join(["python", "-m", "megarl.train", *kept])


def start_over_command(command: list[str]) -> str:
    """The driver command that starts the run over: :func:`resume_command` with ``trainer.resume=false``."""
    return f"{resume_command(command)} trainer.resume=false"
