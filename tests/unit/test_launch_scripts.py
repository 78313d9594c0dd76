"""The launch examples: valid bash, and the torchrun one hands torchrun what the README says."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch"


def test_scripts_parse():
    for folder in (LAUNCH, ROOT / "scripts" / "megatron", ROOT / "scripts" / "gpu"):
        for script in (p for p in folder.iterdir() if p.is_file()):
            if script.suffix == ".py":
                compile(script.read_text(), str(script), "exec")  # (no .pyc left in the tree)
            else:
                subprocess.run(["bash", "-n", str(script)], check=True)


def test_torchrun_multinode_arguments(tmp_path):
    fake = tmp_path / "torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", NNODES="4", MIN_NODES="2",
               NPROC_PER_NODE="8", MASTER_ADDR="node0", RDZV_ID="job7")
    out = subprocess.run(["bash", str(LAUNCH / "torchrun_multinode.sh"), "train.py", "--deepspeed_config", "c.json"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["--nnodes=2:4", "--nproc-per-node=8", "--max-restarts=3", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=node0:29500", "--rdzv-id=job7", "train.py", "--deepspeed_config", "c.json"]
    usage = subprocess.run(["bash", str(LAUNCH / "torchrun_multinode.sh")], env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
