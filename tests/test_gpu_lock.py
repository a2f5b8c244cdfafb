"""requirements-gpu.lock: exact pins on top of requirements.lock that pip's resolver accepts together.

The ``network`` tests ask PyPI (https://pypi.org) and fail without it; they leave this machine's pip
configuration out (no constraint file, no extra index or wheel directory), so that they read what a
GPU machine installing from PyPI gets. Pip's resolver judges the packages installed with their
dependencies; the three installed with --no-deps (sglang, megatron-bridge, transformer_engine_torch)
have their declared requirements checked against the pins here, with the known gaps named below.
"""
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK, GPU_LOCK = ROOT / "requirements.lock", ROOT / "requirements-gpu.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^=\s;,]+)$")
# Installed with --no-deps by tools/setup_venv.sh and tools/setup_gpu_venv.sh.
NO_DEPS = ("sglang", "megatron-bridge", "transformer-engine-torch")
# sglang's requirements that neither lock installs, and what needs them.
SGLANG_NOT_INSTALLED = {
    "anthropic": "the Anthropic API frontend of sglang.lang",
    "build": "packaging tools",
    "deepseek-recipe": "a DeepSeek chat renderer",
    "kernels": "an optional (try/except) FA3 download from the Hugging Face hub",
    "mistral-common": "Mistral tokenizers and the Voxtral model",
    "modelscope": "ModelScope downloads and the diffusion runtime",
    "smg-grpc-servicer": "the gRPC server entrypoint",
    "timm": "DeepSeek-VL2's vision tower",
    "tml-renderers": "the Inkling chat renderer",
    "torchaudio": "audio processors",
    "torchcodec": "audio and video decoding",
}
# megatron-bridge's requirements installed at another version than it declares: transformers is
# sglang's pin (requirements.lock), flashinfer-python is sglang's pin; bridge imports neither version-
# specifically and never imports flashinfer (megatron-core does, only on its own inference paths).
BRIDGE_OTHER_VERSION = frozenset({"transformers", "flashinfer-python"})


def read_lock(path: Path) -> dict[str, tuple[str, str]]:
    """{canonical name: (name as written, version)} of a lock; a line that is not ``name==version`` or a
    name given twice raises ValueError naming the line."""
    pins: dict[str, tuple[str, str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = PIN.match(line.strip())
        if match is None:
            raise ValueError(f"{path.name}:{number}: {line!r} is not an exact pin name==version")
        name, version = match.groups()
        Version(version)  # raises InvalidVersion on a version PEP 440 does not parse
        if canonicalize_name(name) in pins:
            raise ValueError(f"{path.name}:{number}: {name} is pinned twice")
        pins[canonicalize_name(name)] = (name, version)
    return pins


@pytest.mark.unit
def test_read_lock_refuses_ranges_and_repeats(tmp_path):
    for text, error in (("torch>=2.14\n", "is not an exact pin"), ("torch==2.14.1\nTorch==2.14.1\n", "pinned twice"),
                        ("ninja\n", "is not an exact pin")):
        (tmp_path / "x.lock").write_text(text)
        with pytest.raises(ValueError, match=error):
            read_lock(tmp_path / "x.lock")


@pytest.mark.unit
def test_gpu_lock_pins_exactly_what_the_cpu_lock_does_not():
    cpu, gpu = read_lock(CPU_LOCK), read_lock(GPU_LOCK)
    repeated = sorted(f"{gpu[name][0]}=={gpu[name][1]} (requirements.lock: =={cpu[name][1]})"
                      for name in gpu.keys() & cpu.keys())
    assert not repeated, f"requirements-gpu.lock repeats packages of requirements.lock: {repeated}"


def pip_env() -> dict[str, str]:
    """This environment without any PIP_* setting and without pip's configuration files."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def start_dry_run(report: Path, arguments: list[str]) -> subprocess.Popen:
    """``pip install --dry-run`` with ``arguments`` (requirements and options), writing its report."""
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--report", str(report), *arguments]
    return subprocess.Popen(command, env=pip_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, report: Path) -> dict[str, dict]:
    """{canonical name: the report's metadata} once ``process`` is done; pip's output on failure."""
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, f"pip (needs https://pypi.org) failed:\n{output[-6000:]}"
    return read_report(report)


def read_report(report: Path) -> dict[str, dict]:
    """{canonical name: metadata} of the packages a pip ``--report`` file installs."""
    items = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in items}


# pip's reports are kept this long, per content of both locks (and interpreter, pip and torch version):
# the same question to PyPI gets the same answer unless a release is yanked or replaced meanwhile.
RESOLUTION_MAX_AGE_S = 24 * 3600


def resolution_cache() -> Path:
    """The directory of this question's cached reports: under ``$XDG_CACHE_HOME`` (else ~/.cache), named
    by a hash of both locks' bytes, the interpreter's version and the installed pip and torch (the
    --no-deps metadata of transformer_engine_torch is computed against this torch)."""
    from importlib.metadata import version

    key = hashlib.sha256(CPU_LOCK.read_bytes() + b"\0" + GPU_LOCK.read_bytes())
    key.update(f"{sys.version} pip {version('pip')} torch {version('torch')} {NO_DEPS}".encode())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "megarl-tests" / "pip-resolution" / key.hexdigest()[:32]


def dry_run_reports(work: Path, pins: dict[str, tuple[str, str]]) -> tuple[dict, dict]:
    """Both dry runs at once (see :func:`resolved`), or their reports from :func:`resolution_cache` when
    both are younger than RESOLUTION_MAX_AGE_S; a fresh pair is cached once both succeeded."""
    cache = resolution_cache()
    names = ("with_deps", "no_deps")
    if all((cache / f"{name}.json").is_file() and time.time() - (cache / f"{name}.json").stat().st_mtime
           < RESOLUTION_MAX_AGE_S for name in names):
        return tuple(read_report(cache / f"{name}.json") for name in names)
    lines = [f"{name}=={version}" for key, (name, version) in pins.items() if key not in NO_DEPS]
    (work / "with_deps.txt").write_text("\n".join(lines) + "\n")
    no_deps = [f"{pins[key][0]}=={pins[key][1]}" for key in NO_DEPS]
    processes = (start_dry_run(work / "with_deps.json", ["-r", str(work / "with_deps.txt")]),
                 start_dry_run(work / "no_deps.json", ["--no-deps", "--no-build-isolation", *no_deps]))
    reports = tuple(finish(process, work / f"{name}.json") for process, name in zip(processes, names))
    cache.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(work / f"{name}.json", cache / f"{name}.json")
    return reports


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """Both dry runs at once: ``with_deps`` is pip's resolution of every pin but the --no-deps three,
    ``no_deps`` the metadata of those three (transformer_engine_torch's computed by its setup.py against
    this environment's torch, as the --no-build-isolation install does); cached for a day
    (:func:`dry_run_reports`)."""
    assert (sys.platform, platform.machine(), sys.version_info[:2]) == ("linux", "x86_64", (3, 12)), \
        "the GPU locks are resolved for Linux x86_64 and Python 3.12; run this test there"
    pins = {**read_lock(CPU_LOCK), **read_lock(GPU_LOCK)}
    with_deps, no_deps = dry_run_reports(tmp_path_factory.mktemp("gpu_lock"), pins)
    return {key: version for key, (_, version) in pins.items()}, with_deps, no_deps


def unmet(metadata: dict, pins: dict[str, str]) -> tuple[list[str], list[str]]:
    """(requirements of ``metadata`` naming a package no lock pins, those the pinned version does not
    satisfy), markers evaluated for this interpreter without extras."""
    missing, conflicting = [], []
    for text in metadata.get("requires_dist", []):
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in pins:
            missing.append(name)
        elif not requirement.specifier.contains(pins[name], prereleases=True):
            conflicting.append(f"{requirement} (pinned {pins[name]})")
    return missing, conflicting


@pytest.mark.network
def test_pip_resolves_both_locks_to_exactly_their_pins(resolved):
    pins, with_deps, _ = resolved
    got = {name: metadata["version"] for name, metadata in with_deps.items()}
    want = {name: version for name, version in pins.items() if name not in NO_DEPS}
    assert {name: Version(version) for name, version in got.items()} == \
        {name: Version(version) for name, version in want.items()}, \
        f"pulled in beyond the locks: {sorted(got.keys() - want.keys())}; " \
        f"resolved to another version: {sorted(n for n in got.keys() & want.keys() if got[n] != want[n])}"


@pytest.mark.network
def test_no_deps_packages_find_their_requirements_pinned(resolved):
    pins, _, no_deps = resolved
    te_missing, te_conflicting = unmet(no_deps["transformer-engine-torch"], pins)
    assert (te_missing, te_conflicting) == ([], []), "transformer_engine_torch's requirements"
    sglang_missing, sglang_conflicting = unmet(no_deps["sglang"], pins)
    assert sglang_conflicting == [], "sglang's requirements at another version"
    assert sorted(sglang_missing) == sorted(SGLANG_NOT_INSTALLED), "sglang's requirements no lock installs"
    _, bridge_conflicting = unmet(no_deps["megatron-bridge"], pins)
    names = {canonicalize_name(Requirement(text.split(" (pinned")[0]).name) for text in bridge_conflicting}
    assert names == BRIDGE_OTHER_VERSION, f"megatron-bridge's requirements at another version: {bridge_conflicting}"
