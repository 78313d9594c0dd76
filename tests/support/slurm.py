"""A real single-host Slurm for the tests (issue 26): munged, slurmctld and slurmd from Debian's slurm-wlm
(22.05; scripts/get_slurm.sh installs it), one node -- this host -- with its own ports, state and logs
under a temporary folder. Jobs are submitted with the real ``sbatch`` and watched with ``scontrol``.

One host carries one node name here (Debian's slurmd is not built with --enable-multiple-slurmd), so an
excluded host leaves the job nowhere to run: the tests read the exclusion back from ``scontrol show job``.
A requeued job waits for its BeginTime (Slurm holds a requeued job ~2 minutes); the tests release it at
once (``scontrol update StartTime=now``), as an operator may.

:func:`unavailable` says why Slurm cannot run here (the tests skip with that reason).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")


def unavailable() -> str | None:
    """Why a local Slurm cannot be started (None: it can)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): bash scripts/get_slurm.sh installs "
                "slurm-wlm and munge from Debian (root)")
    if os.geteuid() != 0:
        return "a local slurmd and munged need root (run the suite as root, as CI does)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.started: list[str] = []

    # ------------------------------------------------------------------ start / stop
    def start(self, timeout: float = 60.0) -> "LocalSlurm":
        for d in ("state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        ctld, slurmd = _free_port(), _free_port()
        cpus = os.cpu_count() or 2
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=trainguard", f"SlurmctldHost={self.node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.log",
            f"SlurmctldPort={ctld}", f"SlurmdPort={slurmd}", "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none", "MpiDefault=none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "ReturnToService=2", "JobRequeue=1", "SlurmdTimeout=30",
            "InactiveLimit=0", "MinJobAge=600", "KillWait=5",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP", ""]))
        self._munge()
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_exe(daemon)], env=self.env, check=True, timeout=30, capture_output=True)
            self.started.append(daemon)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the local Slurm did not come up within {timeout:.0f} s:\n{self.logs()}")

    def _munge(self) -> None:
        sock = Path("/run/munge/munge.socket.2")
        if sock.exists():
            return  # (a munged already runs: the cluster uses it)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["chown", "munge:munge", "/run/munge"], capture_output=True)
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
        subprocess.run([_exe("munged"), "--force"], check=True, timeout=30, capture_output=True)
        self.started.append("munged")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True)
        for daemon in ("slurmd", "slurmctld"):
            pid_file = self.root / "run" / f"{daemon}.pid"
            if daemon in self.started and pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
                except (OSError, ValueError):
                    pass
        if "munged" in self.started:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.root / "log").glob("*.log")))

    # ------------------------------------------------------------------ jobs
    def sbatch(self, args: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                             capture_output=True, text=True, check=True, timeout=30)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job``'s fields (``{}`` once the record is gone)."""
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True, text=True)
        fields = {}
        for item in out.stdout.split():
            if "=" in item:
                k, _, v = item.partition("=")
                fields[k] = v
        return fields

    def wait(self, job_id: str, until, timeout: float, release: bool = True) -> dict:
        """Poll the job until ``until(fields)``; a requeued job waiting for its BeginTime is released at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if until(fields):
                return fields
            if release and fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=self.env,
                               capture_output=True)
            time.sleep(1.0)
        raise TimeoutError(f"job {job_id} after {timeout:.0f} s: {self.job(job_id)}\n{self.logs()}")

    def node_state(self) -> dict:
        """``scontrol show node``'s fields for this host (State, Reason, ...)."""
        out = subprocess.run(["scontrol", "show", "node", "-o", self.node], env=self.env, capture_output=True,
                             text=True)
        fields, key = {}, None
        for item in out.stdout.split():
            if "=" in item:
                key, _, v = item.partition("=")
                fields[key] = v
            elif key:  # (a Reason with spaces)
                fields[key] += " " + item
        return fields

    def cancel(self, job_id: str) -> None:
        subprocess.run(["scancel", job_id], env=self.env, capture_output=True)
