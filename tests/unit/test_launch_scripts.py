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


def _slurm(tmp_path, worker_exit: int):
    """scripts/launch/slurm_deepspeed.sbatch with Slurm's srun/scontrol faked (recorded) and a real
    torchrun (1 node, 1 process, no restarts) whose worker exits ``worker_exit`` -- 75 the way
    trainguard's watchdog exits after a hang. Returns (exit code, what scontrol was asked)."""
    import socket
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nif [ "$1" = show ]; then echo 127.0.0.1; '
                                      'else echo "$@" >> "$SCONTROL_LOG"; fi\n')
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nfrom trainguard.liveness.watchdog import exit_for_restart\ncode = int(sys.argv[1])\n"
                      "exit_for_restart(code, {'why': 'test'}) if code == 75 else sys.exit(code)\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / f"scontrol.{worker_exit}.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", SLURM_JOB_NODELIST="n1",
               SLURM_NNODES="1", SLURM_JOB_ID="42", NPROC_PER_NODE="1", MAX_RESTARTS="0", MASTER_PORT=str(port),
               LOG_DIR=str(tmp_path), SCONTROL_LOG=str(log), PYTHONPATH=str(ROOT),
               TRAINGUARD_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run(["bash", str(ROOT / "scripts" / "launch" / "slurm_deepspeed.sbatch"), str(worker),
                           str(worker_exit)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, (log.read_text() if log.exists() else ""), done.stderr


def test_slurm_requeues_after_a_hang_exit_that_torchrun_reported_as_1(tmp_path):
    """Issue 15 item 3: torchrun exits 1 when its worker exits 75, so the script's `rc -eq 75` branch
    never ran. The watchdog's marker file is what the script reads now."""
    rc, asked, err = _slurm(tmp_path, 75)
    assert rc == 1, err[-2000:]  # torchrun's own code: 75 does not get through
    markers = list(tmp_path.glob("state/hang.42.*/trainguard-hang.42"))  # (the attempt's own 0700 folder)
    assert "requeue 42" in asked and len(markers) == 1 and markers[0].read_text().count('"exit_code": 75') == 1
    assert markers[0].parent.stat().st_mode & 0o777 == 0o700 == markers[0].parent.parent.stat().st_mode & 0o777
    rc, asked, err = _slurm(tmp_path, 3)  # a crash (or an abort): a person looks first, no requeue
    assert rc == 1 and asked == "", asked


def test_a_broken_trainguard_under_trainguard_run_stops_the_job_instead_of_training_unguarded(tmp_path):
    """Issue 25 item 10: the bootstrap printed a line and let the job train unguarded when trainguard failed to
    import in the workers' environment. It now stops at the framework's import, naming why; TRAINGUARD_REQUIRED=0
    lets it go on (with a warning)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import trainguard

    bootstrap = Path(trainguard.__file__).parent / "bootstrap" / "site"
    fake = tmp_path / "site"
    (fake / "ds_plugins").mkdir(parents=True)
    (fake / "ds_plugins" / "__init__.py").write_text("raise ImportError('a broken install')\n")
    (fake / "deepspeed.py").write_text("")  # the framework the job imports (a stand-in: the hook fires on its name)
    code = "import deepspeed; print('trained unguarded')"
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINGUARD_REQUIRED", "TORCHELASTIC_RESTART_COUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(bootstrap), str(fake)])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "trained unguarded" not in out.stdout
    assert "a broken install" in out.stderr and "TRAINGUARD_REQUIRED=0" in out.stderr
    out = subprocess.run([sys.executable, "-c", code], env={**env, "TRAINGUARD_REQUIRED": "0"}, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and "trained unguarded" in out.stdout and "training goes on unguarded" in out.stderr


def _requeue(tmp_path, suspect: dict | None, drain: bool = True, fail: bool = False):
    """scripts/launch/slurm_requeue.sh after a hang exit (75) of job 42 on nodes n[1-2], with a stand-in scontrol
    that records what it is asked (and fails every update when ``fail``). Returns (what scontrol was asked to
    change, stderr)."""
    import json
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\necho "$@" >> "$SCONTROL_LOG"\ncase "$1 $2" in\n'
        '  "show hostnames") if [ "$3" = "n[1-2]" ]; then printf "n1\\nn2\\n"; else printf "%s\\n" "$3"; fi;;\n'
        '  "show job") echo "JobId=42 ExcNodeList=(null)";;\n'
        '  *) if [ -n "${SCONTROL_FAIL:-}" ]; then echo "slurm_update error: Invalid node name" >&2; exit 1; fi;;\n'
        'esac\n')
    (bin_dir / "scontrol").chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    (logs / "suspect_hosts.json").unlink(missing_ok=True)
    if suspect is not None:
        (logs / "suspect_hosts.json").write_text(json.dumps(suspect))
    for name in ("gpu-a", "gpu-b"):  # (what a glob in the working directory would expand to)
        (tmp_path / name).write_text("")
    log = tmp_path / "scontrol.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="42", SCONTROL_LOG=str(log),
               TRAINGUARD_DRAIN_SUSPECTS="1" if drain else "0", **({"SCONTROL_FAIL": "1"} if fail else {}))
    done = subprocess.run(["bash", str(LAUNCH / "slurm_requeue.sh"), "75", str(logs)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 75, done.stderr
    asked = [x for x in (log.read_text().splitlines() if log.exists() else []) if x.startswith(("update", "requeue"))]
    return asked, done.stderr


def test_slurm_requeue_excludes_and_drains_only_this_jobs_own_nodes(tmp_path):
    """Issue 35 item 5: suspect_hosts.json reached scontrol unchecked -- a '*' was globbed into every file name of the
    working directory, a node range drained 512 nodes, a previous job's file (or anyone's who can write LOG_DIR)
    excluded and drained arbitrary nodes, a fully qualified name failed silently. Now only this job's file, only
    names that are nodes of this job, every scontrol failure logged."""
    drain = "update NodeName=n2 State=DRAIN"
    asked, err = _requeue(tmp_path, {"job_id": "42", "hosts": ["n2"]})
    assert "requeue 42" in asked and "update JobId=42 ExcNodeList=n2" in asked
    assert [x for x in asked if x.startswith("update NodeName")] == [x for x in asked if x.startswith(drain)] != []
    # a fully qualified name of a node of this job: that node
    asked, err = _requeue(tmp_path, {"job_id": "42", "hosts": ["n2.cluster.example"]})
    assert "update JobId=42 ExcNodeList=n2" in asked and any(x.startswith(drain) for x in asked)
    # a glob, a node range, a comma list, a node of another job: set aside, each named
    asked, err = _requeue(tmp_path, {"job_id": "42", "hosts": ["*", "gpu[001-512]", "n1,n2", "n9"]})
    assert asked == ["requeue 42"], asked
    assert err.count("set aside") == 4 and "gpu-a" not in " ".join(asked)
    # a previous job's file, and one with no job id: nothing acted on
    for stale in ({"job_id": "41", "hosts": ["n2"]}, {"hosts": ["n1"]}):
        asked, err = _requeue(tmp_path, stale)
        assert asked == ["requeue 42"] and "ignored" in err, (asked, err)
    # scontrol refusing: every failure is in the log (it was discarded before)
    asked, err = _requeue(tmp_path, {"job_id": "42", "hosts": ["n2"]}, fail=True)
    assert "could not drain n2" in err and "requeue 42 failed" in err and "could not exclude n2" in err


def test_a_suspect_file_or_hang_marker_not_the_jobs_own_changes_nothing(tmp_path):
    """Issue 54 probe 6: the suspect file and the hang marker were trusted on the job id alone -- a writer of the log
    folder had all of the job's nodes drained and excluded, and a planted marker turned any crash into a requeue.
    Now each is acted on only when it is a regular file of the job's own user that only it may write."""
    import json
    import sys

    good = {"job_id": "42", "hosts": ["n2"]}
    asked, err = _requeue(tmp_path, good)
    assert "update JobId=42 ExcNodeList=n2" in asked
    # the same content, writable by others (or, as root here, owned by another user): ignored, said
    suspect = tmp_path / "logs" / "suspect_hosts.json"
    suspect.chmod(0o666)
    (tmp_path / "logs" / "planted.json").write_text(json.dumps(good))
    planted = [lambda: suspect.chmod(0o666)]
    if os.getuid() == 0:
        planted.append(lambda: (suspect.chmod(0o644), os.chown(suspect, 12345, 12345)))
    planted.append(lambda: (suspect.unlink(), suspect.symlink_to(tmp_path / "logs" / "planted.json")))
    for plant in planted:
        _requeue(tmp_path, good)  # (writes the file afresh, the job's own)
        plant()
        bin_dir = tmp_path / "bin"
        env = dict(os.environ, PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                   SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="42", SCONTROL_LOG=str(tmp_path / "scontrol.log"),
                   TRAINGUARD_DRAIN_SUSPECTS="1")
        (tmp_path / "scontrol.log").unlink(missing_ok=True)
        done = subprocess.run(["bash", str(LAUNCH / "slurm_requeue.sh"), "75", str(tmp_path / "logs")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        asked = (tmp_path / "scontrol.log").read_text()
        assert "ExcNodeList=n2" not in asked and "State=DRAIN" not in asked and "requeue 42" in asked, asked
        assert "ignored" in done.stderr or "no suspect host acted on" in done.stderr, done.stderr
    # a hang marker planted writable by others: a crash (exit 1) stays a crash -- no requeue
    marker = tmp_path / "logs" / "trainguard-hang.42"
    marker.write_text('{"exit_code": 75}\n')
    marker.chmod(0o666)
    env["TRAINGUARD_HANG_MARKER"] = str(marker)
    (tmp_path / "scontrol.log").unlink(missing_ok=True)
    done = subprocess.run(["bash", str(LAUNCH / "slurm_requeue.sh"), "1", str(tmp_path / "logs")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    log = tmp_path / "scontrol.log"
    assert done.returncode == 1 and "requeue" not in (log.read_text() if log.exists() else "") \
        and "not this job's user's own file" in done.stderr, done.stderr
    marker.chmod(0o600)  # the job's own: the hang is requeued
    (tmp_path / "scontrol.log").unlink(missing_ok=True)
    subprocess.run(["bash", str(LAUNCH / "slurm_requeue.sh"), "1", str(tmp_path / "logs")], cwd=tmp_path, env=env,
                   capture_output=True, text=True, timeout=60)
    assert "requeue 42" in (tmp_path / "scontrol.log").read_text()
