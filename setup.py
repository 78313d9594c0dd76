"""Distribution "trainguard": a plugin suite that keeps DeepSpeed and Megatron-core runs alive.

Floors, not pins or caps: installing into a cluster environment that already has torch, DeepSpeed
or megatron-core must not change their versions. torch is deliberately *not* a hard requirement here: an unpinned torch
resolved from scratch pulls a multi-GB CUDA build; install your torch first (README).
"""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(HERE, "trainguard", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _readme():
    with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


setup(
    name="trainguard",
    version=_version(),
    description="Prevent, detect and recover from training failures in DeepSpeed and Megatron-core runs",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["trainguard", "trainguard.*", "ds_plugins", "ds_plugins.*",
                                    "megatron_hooks", "megatron_hooks.*"]),
    package_data={"trainguard": ["demo/*.json", "drill/*.json"]},
    install_requires=[
        # torch is required at run time but not declared: see the module docstring.
        "pydantic>=2.5,<3",
        "numpy>=1.23",
    ],
    extras_require={
        # floors only, at the versions the tests run (deepspeed 0.19.8; megatron-core 0.16.1, 0.17.1, 0.19.2):
        # an install into a cluster's environment never downgrades its framework
        "deepspeed": ["deepspeed>=0.19.8"],
        "megatron": ["megatron-core>=0.16.1", "psutil"],
        "monitor": ["tensorboard>=2.10", "prometheus-client>=0.17", "matplotlib>=3.6", "wandb>=0.17"],
        # the zero-code entry is tested under Hugging Face's Trainer and Accelerate (tested: 5.24 / 1.15)
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pyyaml>=6", "transformers>=5,<6", "accelerate>=1.15,<2"],
    },
    entry_points={"console_scripts": ["trainguard=trainguard.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
