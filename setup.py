"""megarl: Megatron-native RL post-training for large Mixture-of-Experts LLMs.

Dependencies are pinned in requirements.lock and installed by tools/setup_venv.sh (two of them,
sglang and megatron-bridge, must go in with --no-deps), so install_requires stays empty here.
"""
from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native RL post-training for large MoE LLMs (Keep Routing, Keep Sampling Mask)",
    packages=find_packages(include=["megarl", "megarl.*"]),
    python_requires=">=3.12",
    extras_require={
        # GPU machines: transformer-engine and SGLang's CUDA kernels (see README "GPU install").
        "gpu": ["transformer-engine[core_cu13,pytorch]==2.20.2", "sglang-kernel==0.4.10",
                "flashinfer-python[cu13]==0.7.2"],
    },
    entry_points={"console_scripts": ["megarl-train=megarl.train:main", "megarl-plan=megarl.plan:main"]},
)
