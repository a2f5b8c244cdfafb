"""Multi-node megarl on fake nodes (megarl/rehearsal/fake_nodes.py: network namespaces on one bridge, each with its
own loopback and shared memory): the nodes are isolated as real machines are, an engine refuses
every call that lacks the run's API key, an engine spans two nodes (SGLang ``--nnodes``) and
restarts whole, and one RL run spans three nodes: node 0 holds the Ray head, the driver and a
trainer rank, node 1 the other trainer rank (DP2; which of the two is rank 0 is Ray's choice), and
the SGLang engine with TP2 spans nodes 1 and 2 (``cluster.gpus_per_node=1``: one rank a node);
the weights travel through the distributed (gloo) transport, from the sender on one node to the
engine's ranks on two. Placement: Ray custom resources ``megarl_trainer`` on nodes 0 and 1 and
``megarl_engine`` on nodes 1 and 2 (megarl/parallel/network.py, "Placement").

On one network stack a rank meeting at 127.0.0.1 or an engine bound to it would still work; here
the other nodes cannot reach a node's loopback, so each of those regressions fails the run."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.metrics.sink import read_metrics
from megarl.rehearsal import fake_nodes as netns
from megarl.rehearsal.ray_nodes import RayOnNodes, node_env
from megarl.wire.launch import API_KEY_ENV

FAKE_NODE_COUNT = 3
ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def run_python(node: netns.Node, script: str, *args: str, timeout: float = 120) -> dict:
    """Run ``script`` in ``node``; the JSON object it prints last."""
    result = node.run([PYTHON, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                      env=node_env(), cwd=ROOT)
    assert result.returncode == 0, f"script in node {node.index} failed:\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- the fake nodes are isolated ------------------------------------------------------------------

SERVE = r"""
import socket, sys, threading, time
port, addresses = int(sys.argv[1]), sys.argv[2:]
for host in addresses:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen()
    def serve(s=s, host=host):
        while True:
            c, _ = s.accept()
            c.sendall(host.encode())
            c.close()
    threading.Thread(target=serve, daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""

PROBE = r"""
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as c:
            out[target] = c.recv(64).decode()
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def test_fake_nodes_have_their_own_loopback(fake_nodes):
    """A server on 127.0.0.1 in node B is unreachable from node A, B's bridge address is reachable,
    and nothing outside the bridge is (the nodes have no other route)."""
    a, b = fake_nodes[0], fake_nodes[1]
    assert netns.node_of_pid(os.getpid(), fake_nodes) is None  # the test runs outside the nodes
    port = 5555
    server = b.popen([PYTHON, "-c", SERVE, str(port), "127.0.0.1", b.address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        assert netns.node_of_pid(server.pid, fake_nodes) is b
        from_a = run_python(a, PROBE, f"127.0.0.1:{port}", f"{b.address}:{port}", "192.0.2.1:9")
        from_b = run_python(b, PROBE, f"127.0.0.1:{port}", f"{b.address}:{port}")
    finally:
        server.kill()
        server.wait()
    assert from_a[f"127.0.0.1:{port}"] == "ConnectionRefusedError"  # A's own loopback: nothing there
    assert from_a[f"{b.address}:{port}"] == b.address  # B over the bridge
    assert from_a["192.0.2.1:9"] != "127.0.0.1"  # no route out of the bridge
    assert from_a["192.0.2.1:9"] in ("OSError", "ConnectionRefusedError", "TimeoutError")
    assert from_b == {f"127.0.0.1:{port}": "127.0.0.1", f"{b.address}:{port}": b.address}
    assert [n.address for n in fake_nodes] == ["10.213.0.2", "10.213.0.3", "10.213.0.4"]
    # and each its own shared memory: a segment made in node B is not in node A's /dev/shm, nor in the host's
    made = b.run(["sh", "-c", "echo b > /dev/shm/mrl_probe && cat /dev/shm/mrl_probe"], capture_output=True, text=True)
    seen = a.run(["sh", "-c", "cat /dev/shm/mrl_probe"], capture_output=True, text=True)
    assert made.stdout.strip() == "b" and seen.returncode != 0 and not Path("/dev/shm/mrl_probe").exists()


CRASH = r"""
import os
from megarl.rehearsal import fake_nodes as netns
nodes = netns.FakeNodes(2).up()
print(" ".join([n.namespace for n in nodes] + [nodes.bridge]), flush=True)
os._exit(9)  # no teardown: what a killed test run leaves behind
"""


def test_stale_nodes_of_a_crashed_run_are_removed(fake_nodes):
    """Fake nodes whose owner died are removed by the next setup; live ones (this module's) stay."""
    crashed = subprocess.run([PYTHON, "-c", CRASH], capture_output=True, text=True, timeout=60)
    left = crashed.stdout.split()
    assert crashed.returncode == 9 and len(left) == 3, crashed.stderr
    assert set(left) <= set(netns._namespaces()) | set(netns._links())
    removed = netns.clean_stale()
    assert set(left) <= set(removed)
    assert not set(left) & (set(netns._namespaces()) | set(netns._links()) | set(netns._shm_dirs()))
    ours = {*(n.namespace for n in fake_nodes), fake_nodes.bridge, *fake_nodes._veths}
    assert set(fake_nodes.leftovers()) == ours and not ours & set(removed)  # a live run's nodes stay


ADDRESS = r"""
import json
from megarl.parallel import free_port, node_address, rendezvous_host
from megarl.parallel.network import interface_of
address = node_address()
print(json.dumps({"address": address, "iface": interface_of(address), "rendezvous": rendezvous_host(),
                  "port": free_port(address)}))
"""


def test_node_address_outside_ray(fake_nodes):
    """Outside Ray a node finds its routable address, toward MASTER_ADDR or from its interfaces,
    and binds a free port there; with no Ray cluster the rendezvous stays on loopback."""
    node, head = fake_nodes[1], fake_nodes[0]
    toward_head = run_python_env(node, ADDRESS, MASTER_ADDR=head.address)
    from_interfaces = run_python_env(node, ADDRESS)
    for found in (toward_head, from_interfaces):
        assert (found["address"], found["iface"], found["rendezvous"]) == (node.address, "eth0", "127.0.0.1")
        assert found["port"] > 0


def run_python_env(node: netns.Node, script: str, **env: str) -> dict:
    result = node.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=120, env=node_env(**env),
                      cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_client_sends_the_key_on_every_call(tiny_checkpoint):
    """SGLangClient authenticates generation, control and weight-update calls alike; the key is
    not in the settings' repr nor on the server's command line: it reaches the server in its environment."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from megarl.engines.client import SGLangClient
    from megarl.engines.server import EngineSettings, SGLangEngine
    from megarl.engines.types import ServedModel

    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, body: bytes) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._answer(b'{"weight_version": "3"}')

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    async def calls():
        async with SGLangClient(url, ServedModel.from_hf_config(tiny_checkpoint), api_key="k3y") as client:
            assert await client.weight_version() == 3
            await client.pause_generation()
            await client.begin_weight_update()
            await client.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="g")
            await client.load_weights_from_disk("/nowhere")
            await client.set_weight_version(4)
            await client.end_weight_update()
            await client.continue_generation()
        async with SGLangClient(url, ServedModel.from_hf_config(tiny_checkpoint)) as anonymous:
            await anonymous.flush_cache()

    try:
        asyncio.run(calls())
    finally:
        server.shutdown()
    assert [auth for _, auth in seen[:-1]] == ["Bearer k3y"] * 8 and seen[-1] == ("/flush_cache", None), seen

    settings = EngineSettings(model_path=tiny_checkpoint, api_key="k3y")
    assert "k3y" not in repr(settings) and "k3y" not in str(settings)
    assert not [a for a in SGLangEngine(settings).command() if "k3y" in a or "api-key" in a]
    assert SGLangEngine(settings).environment()[API_KEY_ENV] == "k3y"
    assert API_KEY_ENV not in SGLangEngine(EngineSettings(model_path=tiny_checkpoint)).environment()
    assert SGLangEngine(settings).url.startswith("http://127.0.0.1:")  # no Ray cluster: loopback


# --- an engine refuses calls without the key --------------------------------------------------------

# The engine under megarl's watchdog (EngineActor, without Ray): its liveness check must carry the
# key too, or ensure_healthy would take the refused /model_info for a hung server and restart it.
ENGINE = r"""
import json, os, signal, sys, time
from megarl.engines.actor import EngineActor, WatchdogSettings
from megarl.engines.server import EngineSettings
model, host, key, url_file, log = sys.argv[1:6]
actor = EngineActor(EngineSettings(model_path=model, host=host, api_key=key, dtype="float32",
                                   max_total_tokens=4096, log_path=log),
                    WatchdogSettings(unresponsive_restart_s=20))
def stop(*_):
    actor.stop()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
actor.start()
info = actor.ensure_healthy()
with open(url_file + ".tmp", "w") as f:
    json.dump({"url": info.url, "restarts": info.restarts}, f)
os.rename(url_file + ".tmp", url_file)
while True:
    time.sleep(1)
"""

CALLS = r"""
import asyncio, json, sys
import httpx
from megarl.engines.client import SGLangClient
from megarl.engines.types import SamplingParams, ServedModel
url, model_path, key, other, prompt = sys.argv[1:6]
prompt = json.loads(prompt)
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
ATTACKS = [("POST", "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}),
           ("POST", "/begin_weight_update", {}),
           ("POST", "/update_weights_from_disk", {"model_path": other, "weight_version": "7"}),
           ("POST", "/update_weight_version", {"new_version": "7"}),
           ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                                   "world_size": 2, "group_name": "x", "backend": "gloo"}),
           ("GET", "/model_info", None)]

async def greedy(client):
    await client.flush_cache()
    (s,) = await client.generate_batch([prompt], GREEDY, group_ids=[''], return_routed_experts=False,
                                      return_sampling_mask=False)
    return s.response_ids, [float(x) for x in s.rollout_logprobs]

async def main():
    out = {}
    async with SGLangClient(url, ServedModel.from_hf_config(model_path), 120, api_key=key) as engine:
        out["before"], out["version_before"] = await greedy(engine), await engine.weight_version()
        for name, headers in (("no_key", {}), ("wrong_key", {"Authorization": "Bearer not-the-key"})):
            async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as other_client:
                out[name] = {path: (await other_client.request(method, path, json=body)).status_code
                             for method, path, body in ATTACKS}
                out[name + "_health"] = (await other_client.get("/health")).status_code
        out["after"], out["version_after"] = await greedy(engine), await engine.weight_version()
        await engine.update_weights_from_disk(other, version=5)
        out["updated"], out["version_updated"] = await greedy(engine), await engine.weight_version()
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.fixture
def sharp_checkpoint(tiny_checkpoint, tmp_path):
    """The tiny checkpoint with a 25x lm_head: other weights, for an update to change the output."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "sharp"
    shutil.copytree(tiny_checkpoint, path)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 25.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def wait_for_file(path: Path, process: subprocess.Popen, timeout: float, log: Path) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            pytest.fail(f"the engine did not start (exit {process.poll()}):\n{tail}")
        time.sleep(0.5)
    return path.read_text()


def test_engine_refuses_calls_without_the_key(fake_nodes, tiny_checkpoint, sharp_checkpoint, tmp_path):
    """An engine in node B with an API key, called from node A: without the key (or with a wrong
    one) generation and every weight-update call are refused (401) and change nothing: the
    greedy tokens, their log-probs and the weight version are the same after; with the key the
    same update goes through. The engine's watchdog answers healthy without a restart."""
    import secrets

    from transformers import AutoTokenizer

    a, b = fake_nodes[0], fake_nodes[1]
    key = secrets.token_urlsafe(32)
    url_file, log = tmp_path / "engine.url", tmp_path / "engine.log"
    engine = b.popen([PYTHON, "-c", ENGINE, tiny_checkpoint, b.address, key, str(url_file), str(log)],
                     env=node_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        started = json.loads(wait_for_file(url_file, engine, 300, log))
        url = started["url"]
        assert url.startswith(f"http://{b.address}:") and started["restarts"] == 0, started
        prompt = AutoTokenizer.from_pretrained(tiny_checkpoint)("3+4=")["input_ids"]
        out = run_python(a, CALLS, url, tiny_checkpoint, key, sharp_checkpoint, json.dumps(prompt), timeout=300)
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(60)
        except subprocess.TimeoutExpired:
            engine.kill()
    for name in ("no_key", "wrong_key"):
        assert set(out[name].values()) == {401}, out[name]
        assert out[name + "_health"] == 200  # only the health probe is open
    assert out["version_before"] == out["version_after"] == 0
    assert out["after"][0] == out["before"][0]
    assert out["after"][1] == pytest.approx(out["before"][1], abs=1e-6)
    assert out["version_updated"] == 5
    assert out["updated"][1] != pytest.approx(out["before"][1], abs=1e-3)  # the keyed update took effect
    assert key not in log.read_text(errors="replace")


# --- one RL run over three nodes -------------------------------------------------------------------

ROLES = {0: {"megarl_trainer": 1}, 1: {"megarl_trainer": 1, "megarl_engine": 1}, 2: {"megarl_engine": 1}}
PLACEMENT = re.compile(r"placement: trainer ranks on nodes (\[.*?\]), engines on nodes (\[.*?\]) at (\[.*?\])")

# Runs from node 1 for the whole run: once the engine answers, one call without the key, then the
# engine's weight version (/model_info, with the key) until a synced one shows or the engine is gone.
ENGINE_PROBE = r"""
import json, sys, time
import httpx
url, key, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
out = {"no_key": None, "versions": []}
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        if out["no_key"] is None:
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            out["no_key"] = httpx.post(url + "/generate", json=body, timeout=30).status_code
        r = httpx.get(url + "/model_info", headers={"Authorization": "Bearer " + key}, timeout=30)
    except httpx.TransportError:
        if out["no_key"] is not None:
            break  # the engine is gone: the run ended
        time.sleep(0.5)  # not up yet
        continue
    version = int(r.json()["weight_version"])
    if not out["versions"] or out["versions"][-1] != version:
        out["versions"].append(version)
    if version >= 1:
        break
    time.sleep(0.2)
print(json.dumps(out))
"""


def processes_in(node: netns.Node, marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes in ``node`` whose command line contains ``marker``."""
    found = []
    for pid in node.pids():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            found.append((pid, cmdline))
    return found


@pytest.fixture(scope="module")
def ray_cluster(fake_nodes, tmp_path_factory, request):
    """A Ray cluster over the fake nodes, shared by the module's runs: the head on node 0, a worker on
    nodes 1 and 2, each with two CPUs and its roles' custom resources (the module's ``ROLES``, by default
    this one's). Yields the head's address and Ray's temp dirs (one a node)."""
    cluster = RayOnNodes(fake_nodes, tmp_path_factory.mktemp("ray_cluster"),
                         resources=getattr(request.module, "ROLES", ROLES)).start_all()
    try:
        yield {"address": cluster.address, "temp_dirs": cluster.temp_dirs}
    finally:
        cluster.stop()


def test_rl_run_spans_three_nodes(fake_nodes, ray_cluster, tiny_checkpoint, tmp_path):
    n0, n1, n2 = fake_nodes
    run = tmp_path / "run"
    out_path = tmp_path / "driver.log"
    # Two steps: the second batch is generated from the first sync's weights. No warm-up: it would start
    # the trainer ranks once more before the RL run and nothing here looks at what it learnt.
    args = ["recipe=tiny_moe_cpu", "mode=sync", "steps=2", "placement=disaggregated", "parallel.world_size=2",
            "sync.transport=distributed", "sync.timeout_s=180", "rollout.engine_tp=2", "cluster.gpus_per_node=1",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "warmup.steps=0", f"logging.run_dir={run}",
            f"model.hf_path={tiny_checkpoint}"]
    started = time.monotonic()
    with open(out_path, "w") as out:
        driver = n0.popen([PYTHON, "-m", "megarl.train", *args], env=node_env(RAY_ADDRESS=ray_cluster["address"]),
                          cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = started + 720

    def until(found):
        """Poll ``found()`` every 0.5 s while the driver runs; its first true value (None if none)."""
        while driver.poll() is None and time.monotonic() < deadline:
            value = found()
            if value:
                return value
            time.sleep(0.5)
        return None

    # The engine's node 0 server process (in node 1 or 2: Ray places the engine's nodes), as soon as it
    # appears: its address and port, from its command line, and its key, from its environment; the probe
    # from node 1 starts at once.
    server = until(lambda: [s for node in (n1, n2) for s in processes_in(node, "megarl.engine_process.sglang_main")
                            if "--node-rank 0 " in s[1]])
    assert server, f"no engine started in nodes 1-2 (exit {driver.poll()}):\n{out_path.read_text()[-6000:]}"
    argv = server[0][1].split()
    flags = dict(zip(argv, argv[1:])) | dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    environ = Path(f"/proc/{server[0][0]}/environ").read_bytes().split(b"\0")
    key = dict(v.decode().split("=", 1) for v in environ if b"=" in v).get(API_KEY_ENV)
    assert key and key not in server[0][1], "the engine was started without its key in the environment"
    probe = n1.popen([PYTHON, "-c", ENGINE_PROBE, f"http://{flags['--host']}:{flags['--port']}", key, "600"],
                     env=node_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    placement = until(lambda: PLACEMENT.search(out_path.read_text(errors="replace")))
    assert placement is not None, f"no placement line (exit {driver.poll()}):\n{out_path.read_text()[-6000:]}"
    rank_nodes, engine_nodes, urls = (ast.literal_eval(g) for g in placement.groups())
    # While the run goes on (its two small steps take seconds after the placement line): who runs where, seen
    # from the process table.
    ranks = {node.index: processes_in(node, "TrainerRank") for node in fake_nodes}
    servers = {node.index: processes_in(node, "megarl.engine_process.sglang_main") for node in fake_nodes}

    try:
        driver.wait(max(1.0, deadline - time.monotonic()))
        probe_out, probe_err = probe.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        driver.kill()
        probe.kill()
        pytest.fail(f"the run did not end in time:\n{out_path.read_text()[-6000:]}")
    output = out_path.read_text(errors="replace")
    print(f"\n[measured] 3-node RL run (2 steps): {time.monotonic() - started:.0f} s; {placement.group(0)}")
    assert driver.returncode == 0, output[-8000:]

    # Placement: one trainer rank on each of nodes 0 and 1; the engine on nodes 1 and 2, one TP rank and one
    # server on each, serving HTTP at its node 0's address.
    assert sorted(rank_nodes) == [n0.address, n1.address], rank_nodes
    leader = n1 if flags["--host"] == n1.address else n2
    assert engine_nodes == [leader.address] and urls[0].startswith(f"http://{leader.address}:"), (engine_nodes, urls)
    assert len(ranks[0]) >= 1 and len(ranks[1]) >= 1 and not ranks[2], ranks
    # (a server's children share its command line until they name themselves: count node ranks, not processes)
    node_ranks = {i: {cmd.split("--node-rank ")[1].split()[0] for _, cmd in found} for i, found in servers.items()}
    assert node_ranks == {0: set(), leader.index: {"0"}, 3 - leader.index: {"1"}}, servers
    # The engine runs TP2 over two nodes: the TP ranks each node's server log names (node rank 0's log, then
    # node rank 1's), the leader's rank 0 and the other's rank 1.
    tp_ranks = [set(re.findall(r" (TP\d)\]", log.read_text(errors="replace")))
                for log in (run / "engine-0.log", run / "engine-0.log.node1")]
    assert tp_ranks == [{"TP0"}, {"TP1"}], tp_ranks

    # The engine, asked from node 1: it refuses a call without the key, and served a synced version.
    assert probe.returncode == 0, probe_err
    probe = json.loads(probe_out.strip().splitlines()[-1])
    assert probe["no_key"] == 401, probe
    assert probe["versions"] and probe["versions"][-1] >= 1, probe

    # Two RL steps, each synced into the engine, which generated the next batch with it.
    rows = [r for r in read_metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2], rows
    for row in rows:
        assert row["sync/version"] == row["step"] and row["sync/engines"] == 1 and row["sync/bytes"] > 0, row
        assert row["staleness/max"] == 0, row  # sync mode: the batch came from the engine at version step - 1

    # The key is in no log, metrics file, checkpoint or config of the run, nor anywhere in Ray's
    # session directory (logs, events).
    files = [p for root in (run, *map(Path, ray_cluster["temp_dirs"])) for p in root.rglob("*")
             if p.is_file() and p.stat().st_size < 50_000_000]
    leaked = [str(p) for p in files if key.encode() in p.read_bytes()]
    assert key not in output and not leaked, f"the engine's API key leaked into {leaked or 'the driver output'}"


# --- one engine over two nodes -------------------------------------------------------------------------

# Run in node 0 against the cluster: one engine of TP2 over nodes of one rank each (SGLang --nnodes 2),
# greedy answers with routing; then node 1's server is killed (from outside) and the same answers come
# back from the restarted engine. Prints the answers, where the engine serves and its restarts.
SPANNING_ENGINE = r"""
import asyncio, json, sys, time
import ray
from megarl.engines.types import SamplingParams
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
model, key, prompts, log, killed = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)
ray.init(address="auto")

async def answers(pool):
    out = await pool.generate_batch(prompts, GREEDY, group_ids=["g"] * len(prompts), return_sampling_mask=False)
    return [(s.response_ids, [float(x) for x in s.rollout_logprobs], s.routed_experts.tolist()) for s in out]

async def main():
    settings = EngineSettings(model_path=model, dtype="float32", max_total_tokens=1024, tp=2, nnodes=2, device="cpu",
                              api_key=key, log_path=log)
    pool = await EnginePool.launch([settings], num_cpus=0.5)
    try:
        first = ray.get(pool.actors[0].info.remote())
        out = {"url": first.url, "node": first.node, "before": await answers(pool)}
        print("KILL", flush=True)  # the test kills node 1's server now
        while not __import__("os").path.exists(killed):
            time.sleep(0.2)
        out["after"] = await answers(pool)
        info = ray.get(pool.actors[0].info.remote())
        out.update(restarts=info.restarts, incarnation=info.incarnation, resubmitted=pool.resubmitted)
    finally:
        await pool.aclose()
    print("RESULT " + json.dumps(out), flush=True)  # Ray's actor logs may follow

asyncio.run(main())
"""


def test_an_engine_spans_two_nodes_and_restarts_whole(fake_nodes, ray_cluster, tiny_checkpoint, tmp_path):
    """An engine of two TP ranks on nodes of one rank each: a server on each of nodes 1 and 2 (SGLang
    --nnodes 2, node 1's rank joining node 0's rendezvous over the bridge), HTTP served by its node 0;
    greedy tokens, log-probs and routed experts equal HF's. When the other node's server dies the engine
    restarts on both nodes and answers the same."""
    import psutil
    import torch
    from hf_oracle import load_hf, router_topk, sharpened_checkpoint
    from transformers import AutoTokenizer

    model = str(sharpened_checkpoint(tiny_checkpoint, tmp_path, 25.0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(p) for p in ("3+4=", "9+9=")]
    killed, log = tmp_path / "killed", tmp_path / "engine.log"
    n0 = fake_nodes[0]
    started = time.monotonic()
    driver = n0.popen([PYTHON, "-c", SPANNING_ENGINE, model, "k3y", json.dumps(prompts), str(log), str(killed)],
                      env=node_env(RAY_ADDRESS=ray_cluster["address"]), cwd=ROOT, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in driver.stdout:
            lines.append(line)
            if line.strip() == "KILL":
                break
        assert lines and lines[-1].strip() == "KILL", "".join(lines)[-6000:]
        servers = {node.index: processes_in(node, "megarl.engine_process.sglang_main") for node in fake_nodes}
        node_rank = {i: {cmd.split("--node-rank ")[1].split()[0] for _, cmd in found} for i, found in servers.items()}
        assert node_rank[0] == set() and sorted(node_rank[1] | node_rank[2]) == ["0", "1"], servers
        follower = 1 if node_rank[1] == {"1"} else 2
        pids = {pid for pid, _ in servers[follower]}
        os.kill(next(pid for pid in pids if psutil.Process(pid).ppid() not in pids), signal.SIGKILL)  # the server
        killed.write_text("")
        out, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    lines.append(out)
    print(f"\n[measured] an engine over two nodes, start, restart and two batches: {time.monotonic() - started:.0f} s")
    assert driver.returncode == 0, "".join(lines)[-8000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    leader = 3 - follower
    assert node_rank[leader] == {"0"} and result["node"] == fake_nodes[leader].address
    assert result["url"].startswith(f"http://{fake_nodes[leader].address}:"), result["url"]
    hf = load_hf(model)
    for prompt, (tokens, logprobs, experts) in zip(prompts, result["before"]):
        ids = torch.tensor(prompt + tokens)
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(ids[None, :-1]).logits[0].double(), dim=-1)
        greedy = log_probs[len(prompt) - 1:].argmax(-1).tolist()
        assert tokens == greedy, (tokens, greedy)
        expected = log_probs[len(prompt) - 1:].gather(1, ids[len(prompt):, None]).squeeze(1)
        assert max(abs(a - b) for a, b in zip(logprobs, expected.tolist())) < 1e-4
        routed = router_topk(hf, ids[:-1]).sort(-1).values.tolist()
        assert [[sorted(k) for k in t] for t in experts] == routed
    assert result["restarts"] == 1 and result["incarnation"] == 1, result
    assert [t for t, _, _ in result["after"]] == [t for t, _, _ in result["before"]]


# --- colocated engines beside trainer ranks on two nodes ---------------------------------------------

# Run in node 0 against the cluster: a PP2 trainer whose stages sit on nodes 0 and 1 (a megarl_trainer unit
# each), two colocated engines of one rank pinned beside ranks 0 and 1 (megarl.engines.pinning), one tensor
# sync (each stage's buckets to both engines, each engine fed from the shared memory of its own node), one
# greedy answer per engine.
COLOCATED = r"""
import asyncio, dataclasses, json, sys
import ray
from safetensors.torch import save_file
from megarl.config import default_config, load_config
from megarl.config.components import optimizer_settings
from megarl.engines.pinning import colocated_seats
from megarl.engines.pool import EnginePool
from megarl.engines.server import EngineSettings
from megarl.engines.types import PauseMode, SamplingParams
from megarl.parallel import Layout
from megarl.sync import SyncSettings, WeightSync
from megarl.trainer.actor import TrainerGroup
from megarl.trainer.model_setup import ModelSettings
from megarl.trainer.optimizer import OptimizerSettings
trainer_model, engine_model, prompt, out_dir = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
ray.init(address="auto")

async def answer(client):
    (s,) = await client.generate_batch([prompt], GREEDY, group_ids=[''], return_routed_experts=False,
                                      return_sampling_mask=False)
    return {"tokens": s.response_ids, "logprobs": [float(x) for x in s.rollout_logprobs]}

async def main():
    group = TrainerGroup(Layout(world_size=2, pp=2))
    model = ModelSettings("local", "alltoall", routing_replay=False, recompute="none", recompute_num_layers=None,
                          moe_aux_loss_coeff=0.0, reference=False)
    await group.build(trainer_model, optimizer_settings(default_config()), model)
    places = await group.places()
    settings = [EngineSettings(model_path=engine_model, dtype="float32", max_total_tokens=1024, device="cpu",
                               log_path=f"{out_dir}/engine-{e}.log") for e in range(2)]
    pool = await EnginePool.launch(settings, num_cpus=0.5, seats=[colocated_seats(places, e, 1, 1) for e in range(2)])
    try:
        out = {"trainer_nodes": [p.address for p in places],
               "engine_nodes": [i.node for i in ray.get([a.info.remote() for a in pool.actors])],
               "before": [await answer(c) for c in pool.clients]}
        save_file(await group.export_hf_state(), out_dir + "/model.safetensors", metadata={"format": "pt"})
        base = SyncSettings.from_config(load_config(["recipe=tiny_moe_cpu"]).sync, engine_tp=1)
        sync = WeightSync(dataclasses.replace(base, transport="tensor", bucket_mb=0.25, timeout_s=300,
                                              work_dir=out_dir + "/sync"), group, pool.clients)
        await sync.setup()
        report = await sync.update(1, PauseMode.ABORT)
        await sync.close()
        out.update(after=[await answer(c) for c in pool.clients], buckets=report.buckets, seconds=report.total_s)
    finally:
        await pool.aclose()
        group.shutdown()
    print("RESULT " + json.dumps(out), flush=True)

asyncio.run(main())
"""


def test_colocated_engines_on_two_nodes_take_the_weights_from_their_own_node(fake_nodes, ray_cluster,
                                                                              tiny_checkpoint, tmp_path):
    """Each stage's buckets reach both engines, each from the trainer rank beside it: stage 1's sender on
    one node and the engine on the other get them over the bridge (gloo), the engine maps its own node's
    shared memory (a fake node's /dev/shm is its own: a handle of the other node's would not open). Both
    engines then answer as HF built from the trainer's export."""
    import torch
    from hf_oracle import load_hf, sharpened_checkpoint
    from transformers import AutoTokenizer

    (tmp_path / "sharp").mkdir()
    trainer_model = str(sharpened_checkpoint(tiny_checkpoint, tmp_path / "sharp", 5.0))
    prompt = AutoTokenizer.from_pretrained(tiny_checkpoint).encode("3+4=")
    started = time.monotonic()
    argv = [PYTHON, "-c", COLOCATED, trainer_model, tiny_checkpoint, json.dumps(prompt), str(tmp_path)]
    driver = fake_nodes[0].run(argv, env=node_env(RAY_ADDRESS=ray_cluster["address"]), cwd=ROOT, capture_output=True,
                               text=True, timeout=900)
    print(f"\n[measured] PP2 trainer on two nodes, two colocated engines, one tensor sync: "
          f"{time.monotonic() - started:.0f} s")
    assert driver.returncode == 0, (driver.stdout + driver.stderr)[-8000:]
    result = json.loads(next(line for line in driver.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert sorted(result["trainer_nodes"]) == [fake_nodes[0].address, fake_nodes[1].address]
    assert result["engine_nodes"] == result["trainer_nodes"]  # each engine beside the rank whose device it shares
    shutil.copy(f"{trainer_model}/config.json", tmp_path / "config.json")
    hf = load_hf(str(tmp_path))  # the trainer's gathered export
    for before, after in zip(result["before"], result["after"]):
        ids = torch.tensor(prompt + after["tokens"])
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(ids[None, :-1]).logits[0].float(), dim=-1)[len(prompt) - 1:]
        assert after["tokens"] == log_probs.argmax(-1).tolist()
        assert max(abs(a - b) for a, b in zip(before["logprobs"], after["logprobs"])) > 1e-3  # the sync moved them
        expected = log_probs.gather(1, ids[len(prompt):, None]).squeeze(1).tolist()
        assert max(abs(a - b) for a, b in zip(after["logprobs"], expected)) < 2e-6
