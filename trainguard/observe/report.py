"""``trainguard report LOG --out DIR``: PNG plots from the JSONL log, for people.

Four pictures a newcomer can read without the log: the loss with its moving median and every
event marked by type; raw and clipped gradient norm with the clip limit; the fp16 loss scale and
the cumulative skipped steps; an attention-entropy heatmap (layer x step, the lowest head of each
layer, as a fraction of its maximum). Plus ``overview.png`` with all four.
"""
from __future__ import annotations

import math
from pathlib import Path

from trainguard.metrics.jsonl import read

# one colour and marker per event family, the same in every picture
STYLE = {
    "nonfinite": ("tab:red", "X", "non-finite (step skipped)"),
    "instant_burst": ("tab:orange", "^", "spike: instant burst (bad batch)"),
    "slow_rise": ("tab:purple", "v", "slow rise (LR too high)"),
    "grad_surge": ("tab:pink", "d", "gradient surge"),
    "entropy_collapse": ("tab:brown", "s", "attention entropy collapse"),
    "entropy_saturation": ("tab:olive", "s", "attention entropy saturation"),
    "activation_range": ("tab:cyan", "o", "activation out of range"),
    "samples_rejected": ("tab:gray", "P", "samples rejected by the sanitiser"),
    "abort": ("black", "*", "abort"),
}


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _series(metrics, key):
    xs, ys = [], []
    for m in metrics:
        v = _num(m.get(key))
        if v is not None:
            xs.append(m["step"])
            ys.append(v)
    return xs, ys


def _plot_loss(ax, metrics, events):
    xs, ys = _series(metrics, "loss")
    ax.plot(xs, ys, color="tab:blue", lw=1, label="loss (mean over ranks)")
    mx, my = _series(metrics, "loss_median")
    if mx:
        ax.plot(mx, my, color="tab:green", lw=1.5, ls="--", label="moving median")
    loss_at = dict(zip(xs, ys))
    top = max(ys) if ys else 1.0
    seen = set()
    for e in events:
        if e["event"] not in STYLE:
            continue
        color, marker, label = STYLE[e["event"]]
        y = loss_at.get(e["step"], top)
        ax.scatter([e["step"]], [y], color=color, marker=marker, s=60, zorder=5,
                   label=None if e["event"] in seen else label)
        seen.add(e["event"])
    if ys and max(ys) / max(min(ys), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_title("Loss, its moving median, and what trainguard saw")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper right")


def _plot_grad(ax, metrics, events):
    xs, ys = _series(metrics, "grad_norm")
    ax.plot(xs, ys, color="tab:blue", lw=1, label="global grad norm (raw)")
    cx, cy = _series(metrics, "grad_norm_clipped")
    if cx:
        ax.plot(cx, cy, color="tab:green", lw=1, label="after clipping")
    lx, ly = _series(metrics, "clip_limit")
    if lx:
        ax.plot(lx, ly, color="tab:red", lw=1, ls=":", label="clip limit")
    for e in events:
        if e["event"] in ("grad_surge", "slow_rise") and e["detail"].get("detector") == "grad_norm":
            color, marker, _ = STYLE[e["event"]]
            ax.axvline(e["step"], color=color, alpha=0.3, lw=1)
    if ys and max(ys) / max(min(ys), 1e-12) > 50:
        ax.set_yscale("log")
    ax.set_title("Gradient norm: raw, clipped, limit (vertical lines: surge / rise alerts)")
    ax.set_xlabel("optimizer step")
    ax.legend(fontsize=7, loc="upper right")


def _plot_scale(ax, metrics):
    xs, ys = _series(metrics, "loss_scale")
    ax.plot(xs, ys, color="tab:blue", lw=1, label="loss scale")
    ax.set_ylabel("fp16 loss scale (1 = none)")
    if ys and max(ys) > 1:
        ax.set_yscale("log", base=2)
    elif ys:
        ax.set_ylim(0, 2)  # bf16/fp32: no scaler, a flat line at 1
    ax2 = ax.twinx()
    sx, sy = _series(metrics, "skipped_steps")
    ax2.step(sx, sy, color="tab:red", where="post", label="skipped steps (cumulative)")
    ax2.set_ylabel("skipped steps")
    ax.set_title("Loss scale and skipped steps")
    ax.set_xlabel("optimizer step")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")


def _plot_entropy(ax, fig, metrics):
    rows = [m for m in metrics if m.get("attention_entropy_ratio")]
    if not rows:
        ax.text(0.5, 0.5, "no attention-entropy samples in this log\n(detectors.attention_entropy)",
                ha="center", va="center")
        ax.set_axis_off()
        return
    layers = sorted({k for m in rows for k in m["attention_entropy_ratio"]})
    import numpy as np

    grid = np.full((len(layers), len(rows)), np.nan)
    for j, m in enumerate(rows):
        for i, layer in enumerate(layers):
            heads = [h for h in (m["attention_entropy_ratio"].get(layer) or []) if h is not None]
            if heads:
                grid[i, j] = min(heads)
    steps = [m["step"] for m in rows]
    im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                   extent=[steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5])
    ax.set_yticks(range(len(layers)), [layer.replace(".attn.softmax", "") for layer in layers], fontsize=7)
    ax.set_xlabel("optimizer step (sampled)")
    ax.set_title("Attention entropy / max, lowest head per layer (dark = collapsed)")
    fig.colorbar(im, ax=ax, fraction=0.046)


def render(log: str | Path, out: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = read(log)
    metrics = [x for x in lines if x.get("type") == "metric"]
    events = [x for x in lines if x.get("type") == "event"]
    if not metrics:
        raise ValueError(f"{log}: no metric lines (is this a trainguard JSONL log?)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    panels = [("loss.png", lambda ax, fig: _plot_loss(ax, metrics, events)),
              ("grad_norm.png", lambda ax, fig: _plot_grad(ax, metrics, events)),
              ("loss_scale.png", lambda ax, fig: _plot_scale(ax, metrics)),
              ("attention_entropy.png", lambda ax, fig: _plot_entropy(ax, fig, metrics))]
    for name, draw in panels:
        fig, ax = plt.subplots(figsize=(10, 4.2))
        draw(ax, fig)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    fig, axes = plt.subplots(2, 2, figsize=(16, 9))
    for (name, draw), ax in zip(panels, axes.flat):
        draw(ax, fig)
    fig.suptitle(f"trainguard report: {Path(log).name}, steps {metrics[0]['step']}-{metrics[-1]['step']}, "
                 f"{sum(1 for e in events if e['event'] in STYLE)} events")
    fig.tight_layout()
    fig.savefig(out / "overview.png", dpi=90)
    plt.close(fig)
    written.append(out / "overview.png")
    return written
