"""The test tiers, as a pytest plugin (tests/conftest.py loads it): every test is either marked
``unit`` (it starts no process: ``pytest -m unit`` runs those alone) or known to start processes.

A test is known to start processes when it uses a fixture of :data:`PROCESS_FIXTURES` (directly or
through another fixture) or carries a mark of :data:`PROCESS_MARKS`. The rules, checked on every
collected test:

- a test that is neither marked ``unit`` nor known to start processes fails, saying which mark to add
  (it is also selected by ``-m unit``, so that the unit tier shows the failure too);
- a ``unit`` test that is known to start processes fails before its fixtures are set up;
- while a ``unit`` test runs (its setup, call and teardown), starting a process raises
  :class:`ProcessStarted` before the process starts, and the test fails even where its code catches
  that. A process is started by ``subprocess``, ``os.fork``/``os.posix_spawn``/``os.system``/... (their
  audit events) or a ``multiprocessing`` process of any start method (``torch.multiprocessing.spawn``,
  tests/fresh_python.py), which this plugin makes raise an audit event of its own. A process that a
  module starts while it is imported (a library probing its environment: ``ldconfig -p`` from
  ``ctypes.util.find_library``, ``git rev-parse`` for a version string) does not count: which test
  imports a library first depends on the order the tests run in.

The marks are registered in pyproject.toml.
"""
from __future__ import annotations

import multiprocessing.process
import sys

import pytest

# Fixtures that start Ray (and the trainer ranks of ``run_ranks``), SGLang servers or network namespaces.
PROCESS_FIXTURES = frozenset({"ray_session", "ray_local", "warmed_up", "tiny_engine", "tp2_ep2_engine", "engine",
                              "client", "fake_nodes"})
# Marks that say a test starts processes (or reaches the network) without such a fixture.
PROCESS_MARKS = ("processes", "network")
# Audit events of starting a process (https://docs.python.org/3/library/audit_events.html), and ours.
PROCESS_START_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                                  "os.system", "multiprocessing.Process.start"})

_misfiled = pytest.StashKey[str]()
_guarded: list[str | None] = []  # per running test (innermost last): its node id if it is a unit test
_process_starts: dict[str, list[str]] = {}  # the process starts caught in each unit test


class ProcessStarted(RuntimeError):
    """A test marked ``unit`` started a process."""


def _importing() -> bool:
    """Whether this runs inside a module's import (importlib's frames on the stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _audit(event: str, args: tuple) -> None:
    """The audit hook: inside a unit test (not in an import), a process start is noted and refused."""
    if event in PROCESS_START_EVENTS and _guarded and _guarded[-1] is not None and not _importing():
        started = f"{event}{args!r:.200}"
        _process_starts.setdefault(_guarded[-1], []).append(started)
        raise ProcessStarted(f"a test marked unit started a process: {started}; mark it processes instead")


_start_process = multiprocessing.process.BaseProcess.start


def _start_audited(self: multiprocessing.process.BaseProcess) -> None:
    sys.audit("multiprocessing.Process.start", self.name)
    _start_process(self)


def _install_guard() -> None:
    """Once per process: the audit hook (never removed; it acts only inside a unit test) and the
    audit event of a multiprocessing start."""
    if multiprocessing.process.BaseProcess.start is not _start_audited:
        sys.addaudithook(_audit)
        multiprocessing.process.BaseProcess.start = _start_audited


def misfiling(item: pytest.Item) -> str | None:
    """Why ``item`` is in the wrong tier, None when it is in the right one."""
    fixtures = sorted(PROCESS_FIXTURES.intersection(item.fixturenames))
    marks = [name for name in PROCESS_MARKS if item.get_closest_marker(name)]
    unit = item.get_closest_marker("unit") is not None
    if unit and (fixtures or marks):
        return (f"{item.nodeid} is marked unit but starts processes (fixtures {fixtures}, marks {marks}): "
                "drop the unit mark")
    if not unit and not (fixtures or marks):
        return (f"{item.nodeid} has no tier: mark it unit if it starts no process (the module's `pytestmark` "
                "or the test's), processes if it starts one (subprocess, multiprocessing, fresh_python)")
    return None


def pytest_configure(config: pytest.Config) -> None:
    _install_guard()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Before ``-m`` selects: note each misfiled test; an unmarked one joins the unit tier to fail there."""
    for item in items:
        reason = misfiling(item)
        if reason is not None:
            item.stash[_misfiled] = reason
            if item.get_closest_marker("unit") is None:
                item.add_marker("unit")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item):
    """Guard a unit test's setup, call and teardown (a nested pytester run guards its own tests)."""
    _guarded.append(item.nodeid if item.get_closest_marker("unit") else None)
    try:
        return (yield)
    finally:
        _guarded.pop()
        _process_starts.pop(item.nodeid, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A misfiled test fails here, before its fixtures start anything."""
    if _misfiled in item.stash:
        pytest.fail(item.stash[_misfiled], pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item):
    """A phase of a unit test that started a process fails, even where the test caught ProcessStarted."""
    report = yield
    started = _process_starts.pop(item.nodeid, None)
    if started and report.passed:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} is marked unit but started a process: {started[0]}; mark it processes"
    return report
