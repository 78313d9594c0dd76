"""Installing trainguard into an environment inside the support matrix changes nothing of it (issue 32): the
extras' floors are the matrix's oldest releases, never the newest (setup.py reads trainguard/support/releases.json).

pip resolves ``trainguard[deepspeed]`` (and ``[megatron]`` where megatron-core is installed) from this checkout
against the environment running the test, ``--dry-run --report``: the only thing it would install is trainguard
itself. CI runs it in the suite's environment (the newest releases) and in the oldest row's (DeepSpeed 0.16.9:
scripts/compat.sh) -- where a floor at the newest release made pip *upgrade* the cluster's DeepSpeed."""
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.dist]


def installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.mark.smoke("install")
def test_installing_the_extras_changes_no_installed_version(tmp_path):
    extras = ["deepspeed"] + (["megatron"] if installed("megatron-core") else [])
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           f"{ROOT}[{','.join(extras)}]"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    would = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    changed = {name: (installed(name), version) for name, version in would.items() if name != "trainguard"}
    assert not changed, f"installing trainguard[{','.join(extras)}] would change {changed} (installed, would be)"
    assert "trainguard" in would and installed("deepspeed") is not None


def test_the_wheel_carries_the_support_matrix(tmp_path):
    """Every guarded run reads trainguard/support/releases.json at start: a wheel without it (an editable install hides
    that) would stop every run with FileNotFoundError."""
    import zipfile

    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("trainguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "trainguard/support/releases.json" in names and "trainguard/demo/demo.json" in names
