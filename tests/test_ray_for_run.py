"""The Ray a run starts when none is given (megarl/trainer/launch.py, ``ray_for_run``): its GCS keeps a
bounded number of task events, unless the environment names its own; a cluster joined is left as it is."""
import os

import pytest
import ray

from megarl.trainer import launch

pytestmark = pytest.mark.unit


@pytest.fixture
def init_environment(monkeypatch):
    """``ray.init`` replaced by a recorder of the task-event bound in the environment it starts Ray with."""
    seen = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(launch.TASK_EVENTS_KEPT_ENV, raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append((kw, os.environ.get(launch.TASK_EVENTS_KEPT_ENV))))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    return seen


def test_a_local_ray_keeps_a_bounded_number_of_task_events(init_environment):
    with launch.ray_for_run(4):
        pass
    [(kwargs, bound)] = init_environment
    assert "address" not in kwargs and bound == launch.TASK_EVENTS_KEPT == "1000"


def test_the_environments_bound_wins_and_a_joined_cluster_is_left_as_it_is(init_environment, monkeypatch):
    monkeypatch.setenv(launch.TASK_EVENTS_KEPT_ENV, "50000")
    with launch.ray_for_run(4):
        pass
    monkeypatch.delenv(launch.TASK_EVENTS_KEPT_ENV)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with launch.ray_for_run(4):
        pass
    assert [bound for _, bound in init_environment] == ["50000", None]
    assert init_environment[1][0]["address"] == "10.0.0.1:6379"
