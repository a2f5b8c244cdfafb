"""The engines' API key stays off every command line and out of the engine's log, and the engine
answers only requests that carry it."""
import secrets
from pathlib import Path

import httpx
import psutil
import pytest

from megarl.engines.server import EngineSettings, SGLangEngine

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory):
    """An engine of the tiny checkpoint answering only a fresh key (one starting with '-', as
    ``secrets.token_urlsafe`` keys may), and that key."""
    key = "-" + secrets.token_urlsafe(24)
    settings = EngineSettings(model_path=tiny_checkpoint, dtype="float32", max_total_tokens=1024, api_key=key,
                              log_path=str(tmp_path_factory.mktemp("keyed") / "server.log"))
    with SGLangEngine(settings) as engine:
        yield engine, key


def test_no_command_line_holds_the_key(keyed):
    engine, key = keyed
    server = psutil.Process(engine.pid)
    assert len(server.children(recursive=True)) >= 2  # SGLang's scheduler and detokenizer run too
    readable = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:  # a process gone meanwhile
            continue
        readable += 1
        assert key.encode() not in text, f"{cmdline}: {text.replace(b'\0', b' ')[:200]!r}"
    assert readable > 3


def test_requests_need_the_key(keyed):
    engine, key = keyed
    with httpx.Client(base_url=engine.url, timeout=30) as http:
        assert http.get("/model_info").status_code == 401
        assert http.get("/model_info", headers={"Authorization": "Bearer not-the-key"}).status_code == 401
        assert http.get("/model_info", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        assert http.post("/generate", json=body).status_code == 401
        assert http.post("/generate", json=body, headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_the_key_is_not_in_the_engine_log(keyed):
    engine, key = keyed
    log = engine.log_path.read_text(errors="replace")
    assert log  # the server wrote its start-up there
    assert key not in log
