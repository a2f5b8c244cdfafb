"""megarl: Megatron-native RL post-training for large Mixture-of-Experts LLMs.

Dependencies are pinned in requirements.lock and installed by tools/setup_venv.sh (two of them,
sglang and megatron-bridge, must go in with --no-deps), so install_requires stays empty here. The GPU
packages are pinned in requirements-gpu.lock and installed by tools/setup_gpu_venv.sh (README "GPU install").
"""
from pathlib import Path

from setuptools import find_packages, setup


def gpu_lock_wheels() -> list[str]:
    """requirements-gpu.lock's pins but transformer_engine_torch, an sdist that only an install without
    build isolation (tools/setup_gpu_venv.sh) builds against the installed torch."""
    lines = (Path(__file__).parent / "requirements-gpu.lock").read_text().splitlines()
    return [line for line in lines if line[:1].isalnum() and not line.startswith("transformer_engine_torch==")]


setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native RL post-training for large MoE LLMs (Keep Routing, Keep Sampling Mask)",
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.12",
    extras_require={
        # The GPU lock's wheels; tools/setup_gpu_venv.sh installs them and builds transformer_engine_torch.
        "gpu": gpu_lock_wheels(),
    },
    entry_points={"console_scripts": ["megarl-train=megarl.train:main", "megarl-plan=megarl.plan:main"]},
)
