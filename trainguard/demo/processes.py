"""Launching worker jobs and bounding them (the demo's, the tests', the benches'): torchrun's environment, a command
run with a deadline whose whole process tree is killed when it passes, the workers an agent left behind, and
:func:`run_worker` -- ``nproc`` ranks of a worker module under torchrun, their per-rank results read back -- and
:func:`fresh`, a run's own folder emptied before the demo or the drill runs in it again."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Sequence


def torchrun_env() -> dict:
    env = dict(os.environ)
    # DeepSpeed compiles a small C++ op at the first process-group start; cache it across runs.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def leave(rc: int):
    """End a worker process after its work is done and its engine and process group are destroyed: as
    finalisation would, the non-daemon threads are waited for and the atexit handlers run; the streams are flushed, then ``os._exit`` skips interpreter finalisation -- which costs
    ~1.2 s per process here (tearing down torch's modules) and once aborted a finished run (tests/support/results.py).
    Every file the worker and trainguard write is closed before this (trainguard closes its logs at CLOSE)."""
    import atexit
    import threading

    for t in threading.enumerate():  # (what finalisation would wait for first: the non-daemon threads)
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(rc)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. torchrun starts each worker in its own session,
    so killing the agent's process group alone would leave the workers running."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with DeepSpeed
        os.killpg(pid, signal.SIGKILL)
        return
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    _kill_all(procs)


def _kill_all(procs) -> None:
    """SIGKILL each of ``procs`` (psutil processes; gone ones skipped) and wait for them."""
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def worker_pids(agent_pid: int) -> list[int]:
    """The training processes under a torchrun agent, ordered by their LOCAL_RANK when readable."""
    import psutil

    out = []
    try:
        for p in psutil.Process(agent_pid).children(recursive=True):
            try:
                if "trainguard.demo.worker" in " ".join(p.cmdline()):
                    out.append((int(p.environ().get("LOCAL_RANK", 99)), p.pid))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    except psutil.NoSuchProcess:
        return []
    return [pid for _, pid in sorted(out)]


def run_bounded(cmd: Sequence[str], timeout: float, **popen) -> tuple[int, object, object]:
    """Run ``cmd`` in a session of its own; after ``timeout`` seconds kill its whole process tree
    (torchrun's workers included) and return exit code 124. Returns ``(exit code, stdout, stderr)``
    as ``communicate`` gives them (None where they were not piped)."""
    token = uuid.uuid4().hex
    env = dict(popen.pop("env", None) or os.environ, TRAINGUARD_RUN_TOKEN=token)
    proc = subprocess.Popen(list(cmd), start_new_session=True, env=env, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        return 124, out, err
    finally:
        reap(token)


def reap(token: str) -> int:
    """SIGKILL what a run left behind: the processes whose environment carries its ``TRAINGUARD_RUN_TOKEN``.
    A rank SIGKILLed by a fault orphans its own children (dist_checkpointing's writer processes, a data loader's
    workers) to init, outside the run's process tree, where they would idle for good. Returns how many."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with DeepSpeed
        return 0
    left = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("TRAINGUARD_RUN_TOKEN") == token:
                left.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    _kill_all(left)
    return len(left)


def run_worker(config: str | os.PathLike, out: str | os.PathLike, steps: int, nproc: int = 2,
               extra: Sequence[str] = (), timeout: float = 300, log_name: str = "torchrun.log",
               launcher: Sequence[str] = (), module: str = "trainguard.demo.worker",
               prefix: Sequence[str] = ()) -> tuple[int, list[dict]]:
    """Run ``nproc`` ranks of trainguard.demo.worker; return ``(exit code, per-rank results)``.

    Bounded: the whole process group is killed after ``timeout`` seconds (exit code 124), so a
    hung collective can never hang the caller. ``prefix``: a command the launch runs under (e.g.
    ``trainguard run --``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher,
           "-m", module, *(["--config", str(config)] if config else []), "--steps", str(steps), "--out", str(out),
           *extra]
    with open(out / log_name, "w") as log:
        rc, _, _ = run_bounded(cmd, timeout, stdout=log, stderr=subprocess.STDOUT, env=torchrun_env())
    results = []
    for r in range(nproc):
        p = out / f"result.rank{r}.json"
        results.append(json.loads(p.read_text()) if p.exists() else None)
    return rc, results


def fresh(*folders: str | os.PathLike) -> list[Path]:
    """``folders``, empty, for new runs of the demo's or the drill's: a worker resumes from the checkpoints it finds
    there and appends to its progress files, so a second ``trainguard demo`` or ``drill`` into the same ``--out``
    resumed the first one's finished run. Every folder is checked before any is touched: one a run of ours left
    (the worker's ``starts.rank0.txt`` beside its ``torchrun.log``) is emptied; any other non-empty folder, a file
    or a link in a run's place is refused by name, and nothing is removed."""
    paths = [Path(f) for f in folders]
    for p in paths:
        if p.is_symlink() or (p.exists() and not p.is_dir()):
            raise SystemExit(f"{p} is in the place of a run's folder and is not one (a file or a link): choose "
                             "another --out; nothing was removed")
        if p.is_dir() and any(p.iterdir()) and not ((p / "torchrun.log").is_file() and
                                                    (p / "starts.rank0.txt").is_file()):
            raise SystemExit(f"{p} exists and is not a folder a demo or drill run left (no torchrun.log and "
                             "starts.rank0.txt in it): choose another --out; nothing was removed")
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
    return paths
