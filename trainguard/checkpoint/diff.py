"""``trainguard ckpt diff A B``: what changed between two checkpoints (playbook 5 in docs/playbooks.md).

Read from the checkpoints alone, without a framework: each manifest's lineage (dataset id and
version, config hash, trainguard/torch/framework versions, code revision) and layout (world,
parallel sizes, ZeRO stage, precision); the steps between; from B's guard state (``guard.json``),
the incidents and rollbacks of B's trajectory after A's step; from the ranks' sidecars (tensors and
plain data, loaded with ``weights_only=True``) the quarantined sample ids B holds that A did not.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from trainguard.checkpoint.layout import SIDECAR, CheckpointError
from trainguard.checkpoint.manifest import Manifest


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _torch_before(major: int, minor: int) -> bool:
    import re

    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return m is not None and (int(m.group(1)), int(m.group(2))) < (major, minor)


def read_side(path: str | Path) -> dict:
    """One checkpoint (its tag directory): manifest, guard state, quarantined sample ids."""
    d = Path(path)
    try:
        man = Manifest.read(d)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{d}: not a committed checkpoint (no readable manifest.json: {e})") from None
    guard_file = d / SIDECAR / "guard.json"
    guard = json.loads(guard_file.read_text()) if guard_file.exists() else None
    quarantine: set[int] = set()
    if _torch_before(2, 6):  # (weights_only's allowlist is what makes these reads safe; torch < 2.6 is too loose)
        raise CheckpointError(f"trainguard ckpt diff reads {d / SIDECAR}/rank*.pt with weights_only=True, which is "
                              f"safe only from torch 2.6 (this is {torch.__version__}): upgrade torch to compare "
                              "checkpoints you did not write yourself")
    for f in sorted((d / SIDECAR).glob("rank*.pt")):
        side = torch.load(f, map_location="cpu", weights_only=True)
        data = side.get("data") if isinstance(side, dict) else None
        if isinstance(data, dict):
            quarantine |= {int(i) for i in data.get("quarantine", [])}
    return {"dir": str(d), "manifest": man, "guard": guard, "quarantine": quarantine}


def diff(a_path: str | Path, b_path: str | Path) -> dict:
    a, b = read_side(a_path), read_side(b_path)
    ma, mb = a["manifest"], b["manifest"]

    def changes(x: dict, y: dict) -> dict:
        fx, fy = _flat(x), _flat(y)
        return {k: {"a": fx.get(k), "b": fy.get(k)} for k in sorted(set(fx) | set(fy)) if fx.get(k) != fy.get(k)}

    tried = ((b["guard"] or {}).get("policy") or {}).get("tried", [])
    between = [t for t in tried if ma.step < int(t.get("step", -1)) <= mb.step]
    anomalies = [x for x in (mb.health or {}).get("recent_anomalies", [])
                 if isinstance(x, (list, tuple)) and x and ma.step < int(x[0]) <= mb.step]
    skipped = [(s["guard"] or {}).get("skipped_steps") for s in (a, b)]
    return {
        "a": {"dir": a["dir"], "tag": ma.tag, "step": ma.step},
        "b": {"dir": b["dir"], "tag": mb.tag, "step": mb.step},
        "steps_between": mb.step - ma.step,
        "lineage_changed": changes(ma.lineage, mb.lineage),
        "layout_changed": changes(ma.layout, mb.layout),
        "rollbacks_between": [t for t in between if str(t.get("action", "")).startswith("rollback")],
        "remedies_between": [t for t in between if not str(t.get("action", "")).startswith("rollback")],
        "anomalies_between": anomalies,
        "guard_skipped_steps": {"a": skipped[0], "b": skipped[1]},
        "quarantine_added": sorted(b["quarantine"] - a["quarantine"]),
        "quarantine_removed": sorted(a["quarantine"] - b["quarantine"]),
        "loss": {"a": (ma.health or {}).get("loss"), "b": (mb.health or {}).get("loss")},
    }


def format_diff(d: dict) -> str:
    a, b = d["a"], d["b"]
    lines = [f"A: {a['dir']} (step {a['step']})", f"B: {b['dir']} (step {b['step']})",
             f"steps between: {d['steps_between']}"]
    for title, key in (("lineage", "lineage_changed"), ("layout", "layout_changed")):
        ch = d[key]
        lines.append(f"{title}: " + ("unchanged" if not ch else "CHANGED"))
        lines += [f"  {k}: {v['a']!r} -> {v['b']!r}" for k, v in ch.items()]
    rb = d["rollbacks_between"]
    lines.append(f"rollbacks between: {len(rb)}")
    lines += [f"  step {t['step']}: {t['action']} to {t.get('to_tag')} ({t.get('anomaly')})" for t in rb]
    lines += [f"  step {t['step']}: {t['action']}" for t in d["remedies_between"]]
    an = d["anomalies_between"]
    if an:
        lines.append("anomalies before B's save: " + ", ".join(f"{x[1]}@{x[0]}" for x in an))
    q = d["quarantine_added"]
    lines.append(f"quarantined samples added: {len(q)}" + (f" {q}" if q else ""))
    loss = d["loss"]
    lines.append(f"loss at save: {loss['a']} -> {loss['b']}")
    return "\n".join(lines)
