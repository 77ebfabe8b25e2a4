"""Figures for the cost report, drawn with matplotlib and returned as inline SVG text.

Each function takes plain data (arrays, lists of events) so the report can be rebuilt from
JSON alone; none of them knows about passes.
"""
from __future__ import annotations

import io
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # headless: no display on servers or in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

KIND_COLORS = {
    "parameter": "#4C72B0", "buffer": "#64B5CD", "optimizer_state": "#8172B2", "hyperparameter": "#8C8C8C",
    "constant": "#CCB974",
    "input": "#937860", "activation": "#DD8452", "gradient": "#C44E52", "param_grad": "#DA8BC3",
    "output": "#55A868",
}
GIB = 2**30


def _svg(fig) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog so it inlines in HTML


def _scale(max_bytes: float) -> tuple[float, str]:
    for factor, unit in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= factor:
            return factor, unit
    return 1, "B"


def memory_timeline_svg(panels: Sequence[dict], budget: int | None = None) -> str:
    """Stacked device bytes by tensor kind, one panel per schedule (baseline, plan, ...).

    Each panel: {"title": str, "x": array of positions (step index or seconds), "xlabel": str,
    "by_kind": {kind: bytes per position}}. The budget, if any, is a dashed line on each."""
    top = max((float(np.sum(list(p["by_kind"].values()), axis=0).max()) if p["by_kind"] else 0.0)
              for p in panels)
    factor, unit = _scale(max(top, budget or 0, 1))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharey=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        kinds = [k for k in KIND_COLORS if k in panel["by_kind"]] + \
                [k for k in panel["by_kind"] if k not in KIND_COLORS]
        ys = [np.asarray(panel["by_kind"][k], dtype=float) / factor for k in kinds]
        if ys:
            ax.stackplot(panel["x"], ys, labels=kinds, colors=[KIND_COLORS.get(k, "#999999") for k in kinds],
                         step="post", linewidth=0)
        if budget is not None:
            ax.axhline(budget / factor, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_title(panel["title"], loc="left", fontsize=10)
        ax.set_xlabel(panel.get("xlabel", "step"))
        ax.set_ylabel(f"device memory ({unit})")
        ax.margins(x=0)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return _svg(fig)


def gantt_svg(events: Sequence[dict], streams: Sequence[str] = ("compute", "d2h", "h2d")) -> str:
    """One row per stream; each event {"stream", "start", "end", "label", "kind"} is a bar."""
    colors = {"compute": "#4C72B0", "recompute": "#DD8452", "swap_out": "#C44E52", "swap_in": "#55A868",
              "stall": "#BBBBBB"}
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(streams) + 1.2))
    for row, stream in enumerate(streams):
        bars = [(e["start"], e["end"] - e["start"]) for e in events if e["stream"] == stream]
        kinds = [e.get("kind", stream) for e in events if e["stream"] == stream]
        if bars:
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=[colors.get(k, "#999999") for k in kinds],
                           linewidth=0)
    ax.set_yticks(range(len(streams)), streams)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return _svg(fig)


def batch_curve_svg(rows: Sequence[dict]) -> str:
    """Predicted time per sample against batch size, one line per strategy (tune-batch)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    strategies = sorted({r["strategy"] for r in rows})
    for strategy in strategies:
        points = sorted((r["batch"], r["time_per_sample_s"]) for r in rows
                        if r["strategy"] == strategy and r.get("fits") and r.get("time_per_sample_s"))
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, [y * 1e3 for y in ys], marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    return _finish(fig, ax, "batch size", "predicted time per sample (ms)")


def loss_curve_svg(losses: Sequence[float], first_step: int = 0) -> str:
    """The training loss per step, with its running mean over 20 steps (memsched train)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    steps = np.arange(first_step, first_step + len(losses))
    ax.plot(steps, losses, linewidth=0.8, alpha=0.5, label="loss per step")
    window = min(20, len(losses))
    if window > 1:
        mean = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], mean, linewidth=1.5, label=f"mean of {window} steps")
    return _finish(fig, ax, "step", "training loss")


def _finish(fig, ax, xlabel: str, ylabel: str) -> str:
    """A line chart's labels, grid and legend; its SVG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _svg(fig)
