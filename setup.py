"""Distribution "trainguard": a plugin suite that keeps DeepSpeed and Megatron-core runs alive.

Floors, not pins or caps: installing into a cluster environment that already has torch, DeepSpeed
or megatron-core must not change their versions. The extras' floors are the *oldest* releases of the support
matrix (trainguard/support/releases.json, read here): inside the matrix, ``pip install "trainguard[deepspeed]"`` changes
nothing (tests/dist/test_install_dist.py checks it against DeepSpeed 0.16.9). torch is deliberately *not* a hard
requirement: an unpinned torch resolved from scratch pulls a multi-GB CUDA build; install your torch first (README).
"""
import json
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
    with open(os.path.join(HERE, "trainguard", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


with open(os.path.join(HERE, "trainguard", "support", "releases.json"), encoding="utf-8") as f:
    _MATRIX = json.load(f)["packages"]  # the support matrix (trainguard/support/releases.py reads the same file at start)


def _floor(distribution):
    """The oldest supported release of a distribution in the support matrix."""
    lows = [row["ranges"][0][0] for key, row in _MATRIX.items() if row.get("distribution", key) == distribution]
    return min(lows, key=lambda v: tuple(int(x) for x in v.split(".")))


def _span(distribution):
    """``>=oldest,<past the newest`` of the support matrix: the suite's releases stay inside it."""
    major, minor = (int(x) for x in _MATRIX[distribution]["ranges"][-1][1].split(".")[:2])
    return f"{distribution}>={_floor(distribution)},<{major}.{minor + 1}"


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
    package_data={"trainguard": ["demo/*.json", "drill/*.json", "support/releases.json"]},
    install_requires=[
        # torch is required at run time but not declared: see the module docstring.
        "pydantic>=2.5,<3",
        "numpy>=1.23",
    ],
    extras_require={
        # floors only, at the oldest release of the support matrix: an install into a cluster's environment inside
        # the matrix changes no version of its framework
        "deepspeed": [f"deepspeed>={_floor('deepspeed')}"],
        "megatron": [f"megatron-core>={_floor('megatron-core')}", "psutil"],
        # (wandb apart: it and its own dependencies were most of what a new user's [monitor] pulled, for one sink)
        "monitor": ["tensorboard>=2.10", "prometheus-client>=0.17", "matplotlib>=3.6"],
        "wandb": ["wandb>=0.17"],
        # the suite runs the newest releases inside the support matrix (what a fresh install resolves, capped at the
        # matrix's top: a newer release is refused at start until the matrix says otherwise); the oldest row runs in
        # its own venv (scripts/compat.sh)
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pyyaml>=6", "import-linter>=2.1,<3", _span("transformers"), _span("accelerate")],
    },
    entry_points={"console_scripts": ["trainguard=trainguard.cli:main"],
                  # each adapter's declaration of what it cannot honour (trainguard.support.support.declared)
                  "trainguard.adapters": ["ds_plugins=ds_plugins.capabilities",
                                          "megatron_hooks=megatron_hooks.capabilities"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
