"""The cost report as a self-contained HTML page (figures inlined as SVG, no network at view time),
and the per-tensor decisions table both the page and the JSON carry.

Inputs are plain data: the `compile` report dict, the two simulations' `to_dict()` forms and
the plans; the page is rebuilt the same from a scheduled.onnx read back later.
"""
from __future__ import annotations

import html
import math

from . import figures
from .host_pipeline import InputPipeline, check_on
from .ir import Graph
from .onnx_utils import staged_text, write_text_atomic
from .schedule import Plan, StepKind
from .units import format_bytes, format_seconds

# The ImageNet JPEG pipeline measured in the NVDIMM host-memory study (decode, resize, cast):
# memory accesses per call, bytes per access, and 5 calls per thread for a batch of 64.
JPEG_ACCESSES = (439, 144, 116)
JPEG_ACCESS_BYTES = 907_163
JPEG_CALLS_PER_64 = 5
STORAGE_BW = 2e9  # a datacenter NVMe drive reads about 2 GB/s sequentially


def tensor_decisions(plan: Plan, top: int = 15) -> list[dict]:
    """The largest tensors and what the plan does with each."""
    graph = plan.graph
    swapped: dict[str, set[str]] = {}
    for step in plan.schedule:
        if step.kind == StepKind.SWAP_OUT:
            swapped.setdefault(step.target, set()).add(step.tier or "dram")
    recomputed = {t for step in plan.schedule if step.kind == StepKind.RECOMPUTE
                  for t in graph.op_by_name[step.target].present_outputs}
    rows = []
    for t in sorted(graph.tensors.values(), key=lambda t: (-t.nbytes, t.name))[:top]:
        decisions = []
        if t.name in plan.on_host:
            decisions.append("starts on host")
        if t.name in swapped:
            decisions.append("swapped to " + "+".join(sorted(swapped[t.name])))
        if t.name in recomputed:
            decisions.append("recomputed")
        if t.name in plan.aliases:
            decisions.append(f"in place over {plan.aliases[t.name]}")
        if not decisions:
            decisions.append("resident for the whole step" if t.is_static else "kept")
        rows.append({"name": t.name, "kind": t.kind, "shape": list(t.shape), "bytes": t.nbytes,
                     "decision": ", ".join(decisions)})
    return rows


def input_pipeline(graph: Graph, hw, gpu_step: float, link_busy: float) -> dict | None:
    """The host input-pipeline check for image models (a 4-D or 5-D float input), else None."""
    images = [graph.tensors[n] for n in graph.inputs
              if graph.tensors[n].shape is not None and len(graph.tensors[n].shape) in (4, 5)
              and graph.tensors[n].dtype_name.startswith("float")]
    if not images or "dram" not in hw.tiers or gpu_step <= 0:
        return None
    batch = images[0].shape[0]
    spec = InputPipeline(batch_bytes=sum(t.nbytes for t in images), storage_bw=STORAGE_BW,
                         calls_per_thread=max(1, math.ceil(batch * JPEG_CALLS_PER_64 / 64)),
                         accesses=JPEG_ACCESSES, access_bytes=JPEG_ACCESS_BYTES)
    result = check_on(spec, hw, gpu_step, min(link_busy, gpu_step * 0.999)).to_dict()
    result["assumes"] = ("ImageNet JPEG decode/resize/cast as measured in the NVDIMM host-memory study, "
                         f"{spec.calls_per_thread} calls per thread, storage at {STORAGE_BW / 1e9:.0f} GB/s")
    return result


def _esc(value) -> str:
    return html.escape(str(value))


def _table(headers: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td class='{'num' if i in numeric else ''}'>{_esc(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: dict, baseline_sim: dict, plan_sim: dict) -> str:
    """The whole page. `*_sim` are Simulation.to_dict() with timelines."""
    plan, base = report["plan"], report["baseline"]
    budget = report.get("budget_bytes")
    timeline = figures.memory_timeline_svg([
        {"title": "baseline (its own order, updates in place)", **baseline_sim["memory_timeline"]},
        {"title": f"plan ({', '.join(report['strategies']) or 'no strategies'})", **plan_sim["memory_timeline"]},
    ], budget)
    gantt = figures.gantt_svg(plan_sim["events"])
    summary = _table(["", "baseline", "plan"], [
        ["peak device memory", format_bytes(base["peak_bytes"]), format_bytes(plan["peak_bytes"])],
        ["arena", "-", format_bytes(plan["arena_bytes"])],
        ["predicted step time", format_seconds(base["step_time_s"]), format_seconds(plan["step_time_s"])],
        ["overhead", "-", f"{plan['overhead'] * 100:+.2f}%"],
        ["stall on transfers", "-", format_seconds(plan["stall_s"])],
        ["recomputed ops", "-", len(plan["recomputed_ops"])],
        ["in-place outputs", "-", plan["aliases"]],
    ])
    solver = report["solver"]
    traffic = _table(["tier", "swapped out", "swapped in", "host peak"], [
        [tier, format_bytes(t["out"]), format_bytes(t["in"]), format_bytes(plan_sim["host_peak_bytes"].get(tier, 0))]
        for tier, t in plan_sim["traffic_bytes"].items()] or [["-", "nothing swapped", "", ""]])
    tensors = _table(["tensor", "kind", "shape", "bytes", "decision"],
                     [[t["name"], t["kind"], "x".join(map(str, t["shape"])) or "scalar", format_bytes(t["bytes"]),
                       t["decision"]] for t in report.get("tensors", [])], numeric={3})
    sections = [
        f"<h1>memsched report: {_esc(report['model'])}</h1>",
        f"<p class='verdict'>{_esc(report['verdict'])}</p>",
        f"<p>hardware <b>{_esc(report['hardware'])}</b> ({format_bytes(report['device_memory_bytes'])}), "
        f"budget <b>{format_bytes(budget) if budget is not None else 'none'}</b>, "
        f"{report['graph']['ops']} ops ({'training step' if report['graph']['training'] else 'inference'}), "
        f"solver <b>{_esc(solver['status'])}</b> in {solver['seconds']:.2f} s"
        + (f", lower bound {format_bytes(solver['lower_bound_bytes'])}" if solver.get("lower_bound_bytes") else "")
        + "</p>",
        "<h2>Summary</h2>", summary,
        "<h2>Device memory over the step</h2>", f"<div class='fig' id='timeline'>{timeline}</div>",
        "<h2>Streams</h2>", f"<div class='fig' id='gantt'>{gantt}</div>",
        "<h2>Host tiers</h2>", traffic,
        "<h2>Largest tensors and what was decided</h2>", tensors,
    ]
    if report.get("input_pipeline"):
        p = report["input_pipeline"]
        sections += ["<h2>Input pipeline</h2>",
                     f"<p>storage {format_seconds(p['storage_s'])} + CPU {format_seconds(p['cpu_s'])} + link "
                     f"{format_seconds(p['link_s'])} = {format_seconds(p['total_s'])} against a device step of "
                     f"{format_seconds(p['gpu_step_s'])}: <b>{'hidden' if p['hidden'] else 'NOT hidden'}</b> "
                     f"(slack {format_seconds(p['slack_s'])}). Assumes {_esc(p['assumes'])}.</p>"]
    if report.get("data_parallel"):
        d = report["data_parallel"]
        sections += ["<h2>Data parallel</h2>",
                     f"<p>{d['workers']} workers: step {format_seconds(d['step_no_overlap_s'])} without overlap, "
                     f"{format_seconds(d['step_overlap_s'])} with all-reduce overlapped with the backward pass "
                     f"({format_seconds(d['exposed_comm_s'])} of communication left exposed).</p>"]
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:.5em 0}td,th{border-bottom:1px solid #ddd;padding:.25em .8em;"
             "text-align:left}td.num{text-align:right}.verdict{font-size:1.3em;font-weight:600}"
             ".fig svg{max-width:100%;height:auto}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>memsched report</title>"
            f"<style>{style}</style></head><body>{''.join(sections)}</body></html>")


def write_html(path, report: dict, baseline_sim: dict, plan_sim: dict):
    return write_text_atomic(path, render_html(report, baseline_sim, plan_sim))


def staged_html(path, result):
    """The HTML report of compile `result` written beside `path`, put in place when the block
    ends without an error (`onnx_utils.staged_text`); `path` None: nothing."""
    html = render_html(result.report, result.baseline_sim.to_dict(), result.sim.to_dict()) if path else ""
    return staged_text(path, html)
