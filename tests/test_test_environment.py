"""The environment the tests need is set by the tests (tests/conftest.py), not by the command that runs
them: ``pytest tests/`` directly runs what ``bash launch/test.sh`` runs."""
import os

import pytest

pytestmark = pytest.mark.unit


def test_ray_runs_without_token_auth_whatever_the_machine_holds(tmp_path, monkeypatch):
    """A machine set up for Ray's token authentication (a token in ``~/.ray/auth_token``) turns none of
    the tests' clusters to it: the drivers and nodes they start join without a token."""
    from ray._private.authentication import authentication_token_setup as setup

    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("f" * 32)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
    assert setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False) is False
    assert setup.enable_token_auth_by_default() is False
    assert os.environ["RAY_AUTH_MODE"] == "disabled"

