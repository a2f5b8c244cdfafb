"""``python ...`` runs for the tests, forked from a server that has imported torch and transformers.

``run([sys.executable, "-c", code], env=..., timeout=...)`` answers what ``subprocess.run`` with
``capture_output=True, text=True`` would, for a command that is this interpreter running ``-c CODE``,
``-m MODULE`` or a script, with its arguments. The process is a child of a multiprocessing forkserver
that imported only :data:`PRELOAD` (no megarl, megatron or SGLang module, so every CPU work-around is
applied in the run as in a fresh interpreter), and saves each run the ~4 CPU-s those imports take on this
machine. In the run ``os.environ`` is ``env`` (or this process's environment), ``sys.argv`` and
``sys.path[0]`` are what the interpreter would set, stdout and stderr go to files read back after it
exits; an exception is printed as the interpreter would print it and exits 1, ``SystemExit`` gives its
code, and exit handlers run.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

PRELOAD = ["torch", "transformers.modeling_utils"]

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run_in_child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked child: become ``python argv...`` and exit with its code (never returns)."""
    import atexit
    import runpy
    import traceback

    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 0
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"), as the interpreter does it
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # printed from the run's own frames, as the interpreter prints it
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Run:
    """One started run; ``wait()`` gives its ``subprocess.CompletedProcess``."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None):
        if not command or command[0] != sys.executable or len(command) < 2:
            raise ValueError(f"not a run of this interpreter: {command!r}")
        self.args = list(command)
        self._dir = tempfile.TemporaryDirectory(prefix="fresh-python-")
        self._out, self._err = (os.path.join(self._dir.name, name) for name in ("stdout", "stderr"))
        self._process = _forkserver().Process(
            target=_run_in_child, args=(self.args[1:], dict(os.environ if env is None else env),
                                        str(cwd or os.getcwd()), self._out, self._err))
        self._process.start()

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Its result; after ``timeout`` seconds the run is killed and ``subprocess.TimeoutExpired``
        raised with what it had written (``output``, ``stderr``), as ``subprocess.run`` does."""
        self._process.join(timeout)
        timed_out = self._process.exitcode is None
        if timed_out:
            self._process.kill()
            self._process.join()
        try:
            out, err = (Path(p).read_text(errors="replace") if os.path.exists(p) else ""
                        for p in (self._out, self._err))
        finally:
            self._dir.cleanup()
        if timed_out:
            raise subprocess.TimeoutExpired(self.args, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(self.args, self._process.exitcode, out, err)


def run(command: Sequence[str], env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess:
    """What ``subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``
    gives, for ``command`` = ``[sys.executable, ...]`` (see the module's docstring)."""
    return Run(command, env, cwd).wait(timeout)
