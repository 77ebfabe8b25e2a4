"""Terminal renderings of library results (rich tables). The CLI calls these to print."""
from __future__ import annotations

from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from .errors import printable
from .units import format_bytes, format_seconds


def console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _e(value) -> str:
    """`value` as text rich prints literally: names from models, paths and profiles may hold '[...]',
    which rich would read as markup (a crash on '[/]', a hyperlink from '[link=...]'), and
    control characters, which the terminal would act on (`errors.printable`)."""
    return escape(printable(value))


def print_inspect(summary: dict) -> None:
    out = console()
    out.print(f"[bold]{_e(summary['graph'])}[/bold]: {summary['ops']} ops, {summary['tensors']} tensors, "
              f"{summary['parameters']:,} parameters ({format_bytes(summary['parameter_bytes'])})")
    out.print(f"peak (default order): [bold]{format_bytes(summary['peak_bytes'])}[/bold] "
              f"({summary['peak_bytes']:,} B) at step {summary['peak_step']} ({_e(summary['peak_op'])})")
    by_kind = ", ".join(f"{_e(k)} {format_bytes(v)}" for k, v in summary["peak_by_kind"].items())
    out.print(f"at the peak: {by_kind}")

    ops = Table(title="ops by type", title_justify="left")
    ops.add_column("op type")
    ops.add_column("count", justify="right")
    for op_type, count in summary["op_types"].items():
        ops.add_row(_e(op_type), str(count))
    out.print(ops)

    largest = Table(title="largest tensors", title_justify="left")
    for col, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("kind", "left"),
                         ("bytes", "right")):
        largest.add_column(col, justify=justify)
    for t in summary["largest_tensors"]:
        largest.add_row(_e(t["name"]), "x".join(map(str, t["shape"])) or "scalar", _e(t["dtype"]), _e(t["kind"]),
                        format_bytes(t["bytes"]))
    out.print(largest)


def print_models(entries: list[dict]) -> None:
    """The bundled model zoo: name, parameters at default size, description."""
    table = Table(title="bundled models (memsched models export NAME -o OUT.onnx)", title_justify="left")
    table.add_column("name")
    table.add_column("parameters", justify="right")
    table.add_column("description")
    for entry in entries:
        table.add_row(_e(entry["name"]), f"{entry['parameters']:,}", _e(entry["description"]))
    console().print(table)


def _rate(x: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _table(title: str, *columns: str) -> Table:
    """A left-titled table; a column named 'x>' is right-justified."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col.rstrip(">"), justify="right" if col.endswith(">") else "left")
    return table


def print_hardware_list(profiles: list[dict]) -> None:
    table = _table("hardware profiles", "name", "memory>", "fp32>", "mem bw>", "link h2d/d2h>", "description")
    for p in profiles:
        if "error" in p:
            table.add_row(_e(p["name"]), "-", "-", "-", "-", _e(p["error"]))
            continue
        table.add_row(_e(p["name"]), format_bytes(p["device_memory"]), _rate(p["peak_flops"]["float32"], "FLOP/s"),
                      _rate(p["memory_bandwidth"], "B/s"),
                      f"{_rate(p['link_h2d'], 'B/s')} / {_rate(p['link_d2h'], 'B/s')}", _e(p["description"]))
    console().print(table)


def print_hardware(p: dict) -> None:
    out = console()
    out.print(f"[bold]{_e(p['name'])}[/bold]: {_e(p['description'])}")
    out.print(f"device memory {format_bytes(p['device_memory'])}, bandwidth {_rate(p['memory_bandwidth'], 'B/s')}, "
              f"launch overhead {format_seconds(p['launch_overhead'])}")
    out.print("peak: " + ", ".join(f"{k} {_rate(v, 'FLOP/s')}" for k, v in p["peak_flops"].items()))
    out.print(f"host link: h2d {_rate(p['link_h2d'], 'B/s')}, d2h {_rate(p['link_d2h'], 'B/s')}, "
              f"latency {format_seconds(p['link_latency'])}")
    tiers = _table("host tiers", "tier", "capacity>", "read>", "write>", "latency>")
    for name, t in p["tiers"].items():
        tiers.add_row(_e(name), format_bytes(t["capacity"]), _rate(t["read_bw"], "B/s"), _rate(t["write_bw"], "B/s"),
                      format_seconds(t["latency"]))
    out.print(tiers)
    figures = ("op_class_flops", "op_class_bandwidth", "op_class_overhead", "op_class_loop")
    names = sorted(set().union(*(p.get(key, {}) for key in figures)))
    if names:
        classes = _table("calibrated op classes", "class", "FLOP/s>", "bandwidth>", "per op>", "per loop>")
        for cls in names:
            f, b, o, loop = (p.get(key, {}).get(cls) for key in figures)
            classes.add_row(_e(cls), _rate(f, "FLOP/s") if f else "-", _rate(b, "B/s") if b else "-",
                            format_seconds(o) if o is not None else "-",
                            format_seconds(loop) if loop is not None else "-")
        out.print(classes)


def print_cost_table(summary: dict) -> None:
    out = console()
    out.print(f"[bold]{_e(summary['graph'])}[/bold]: {summary['ops']} ops timed on {_e(summary['provider'])} "
              f"({summary['timed_ops']} distinct), sum of op times {format_seconds(summary['total_s'])}; "
              f"written to {_e(summary['path'])}")
    table = _table("slowest ops", "op", "type", "time>")
    for row in summary["slowest"]:
        table.add_row(_e(row["op"]), _e(row["op_type"]), format_seconds(row["seconds"]))
    out.print(table)


def print_simulation(d: dict) -> None:
    out = console()
    out.print(f"step time [bold]{format_seconds(d['step_time_s'])}[/bold] on {_e(d['hardware'] or '-')} "
              f"({_e(d['cost_source'])} op times): compute {format_seconds(d['compute_busy_s'])}, "
              f"stalled on transfers {format_seconds(d['stall_s'])}")
    out.print(f"peak device memory {format_bytes(d['peak_bytes'])} ({d['peak_bytes']:,} B)")
    for tier, flow in d["traffic_bytes"].items():
        out.print(f"{_e(tier)}: out {format_bytes(flow['out'])}, in {format_bytes(flow['in'])}, "
                  f"held at most {format_bytes(d['host_peak_bytes'].get(tier, 0))}")


@contextmanager
def progress(deadline=None):
    """A spinner on stderr naming what the planner is doing (and the seconds left of
    `deadline`, a memsched.deadline.Deadline); yields the function that updates it."""
    err = Console(stderr=True, highlight=False)
    if not err.is_terminal:
        yield lambda message: None
        return
    with err.status("starting") as status:
        def say(message: str) -> None:
            left = "" if deadline is None or deadline.left() == float("inf") else f" [{deadline.left():.0f} s left]"
            status.update(escape(message + left))
        yield say


def say_interrupted() -> None:
    """What the first Ctrl-C of a compile does."""
    Console(stderr=True, highlight=False).print(
        "interrupted: finishing with the best plan so far (Ctrl-C again to abort)")


def _micro_batches(note: dict, baseline_time: float) -> str:
    """What planning the step in micro-batches (passes.rewrites.batch_split) gave beside the step as given."""
    def said(name: str) -> str:
        time = note["step_time_s"].get(name)
        return f"{(time / baseline_time - 1) * 100:+.1f}%" if time is not None else "no fit"
    head = f"planned in {note['chunks']} micro-batches" if note["chosen"] else \
        f"kept whole (not split into {note['chunks']} micro-batches)"
    return f"{head}: step as given {said('given')}, in micro-batches {said('split')}"


def _fastest_each(tried: list[dict]) -> list[dict]:
    """One attempt per candidate, in the order first tried: the chosen one, else its fastest
    that fit, else its last."""
    by_name: dict[str, dict] = {}
    for t in tried:
        kept = by_name.get(t["candidate"])
        rank = (not t.get("chosen"), not t["fits"], t.get("step_time_s") or 0.0)
        if kept is None or rank <= (not kept.get("chosen"), not kept["fits"], kept.get("step_time_s") or 0.0):
            by_name[t["candidate"]] = t
    return list(by_name.values())


def print_compile(report: dict) -> None:
    """Baseline vs plan, the solver's word, and the one-line verdict."""
    out = console()
    base, plan, solver = report["baseline"], report["plan"], report["solver"]
    budget = report["budget_bytes"]
    out.print(f"[bold]{_e(report['model'])}[/bold] on {_e(report['hardware'])} "
              f"({format_bytes(report['device_memory_bytes'])}), budget "
              f"{format_bytes(budget) if budget is not None else 'none'}, strategies "
              f"{_e(','.join(report['strategies']) or 'none')}")
    table = Table(title_justify="left")
    for col, justify in (("", "left"), ("baseline", "right"), ("plan", "right")):
        table.add_column(col, justify=justify)
    table.add_row("peak device memory", format_bytes(base["peak_bytes"]), format_bytes(plan["peak_bytes"]))
    table.add_row("arena", "-", format_bytes(plan["arena_bytes"]))
    table.add_row("predicted step time", format_seconds(base["step_time_s"]), format_seconds(plan["step_time_s"]))
    table.add_row("overhead", "", f"{plan['overhead'] * 100:+.2f}%")
    table.add_row("recomputed ops", "", str(len(plan["recomputed_ops"])))
    for tier, nbytes in plan["swapped_bytes"].items():
        table.add_row(f"swapped to {_e(tier)}", "", format_bytes(nbytes))
    out.print(table)
    gap = ""
    if solver.get("lower_bound_bytes"):
        gap = f", lower bound {format_bytes(solver['lower_bound_bytes'])}"
    out.print(f"solver: {_e(solver['status'])} in {solver['seconds']:.2f} s{gap}")
    reuse = report["passes"].get("reuse") or {}
    rewrites = [f"{reuse['fused_updates']} optimizer updates fused into the ops that make their gradients"] \
        if reuse.get("fused_updates") else []
    if reuse.get("variant") == "concat-split":
        rewrites.append("convolutions over a Concat split per part")
    if rewrites:
        out.print("reuse rewrote the step: " + "; ".join(rewrites))
    split = report["passes"].get("batch_split")
    if split:
        out.print(_micro_batches(split, base["step_time_s"]))
    fit = report["passes"].get("fit", {})

    def said(t: dict) -> str:
        if not t["fits"]:
            smallest = t.get("smallest_peak_bytes")
            return f"{_e(t['candidate'])}: no fit" + (f" (smallest {format_bytes(smallest)})" if smallest else "")
        over = t.get("arena_bytes") is not None and budget is not None and t["arena_bytes"] > budget
        mark = " (chosen)" if t.get("chosen") else " (arena over the budget)" if over else ""
        return f"{_e(t['candidate'])}: {(t['step_time_s'] / base['step_time_s'] - 1) * 100:+.1f}%{mark}"
    if fit.get("tried"):
        cut = ", cut by the time limit" if fit.get("cut") else ""
        out.print(f"fit ({len(fit['tried'])} attempts{cut}; each candidate's fastest, predicted before placement): "
                  + "; ".join(said(t) for t in _fastest_each(fit["tried"])))
    first, limit = report.get("solver", {}).get("first_fit_s"), report.get("time_limit_s")
    if first is not None and limit is not None and first > limit:
        out.print(f"[yellow]the first plan that fits came {first:.1f} s into the command, past the "
                  f"{limit:g} s time limit: a step this large needs a longer --time-limit[/yellow]")
    for what, path in report.get("written", {}).items():
        out.print(f"wrote {_e(what)}: {_e(path)}")
    out.print(f"[bold]{_e(report['verdict'])}[/bold]")


def print_train_graph(summary: dict) -> None:
    out = console()
    phases = ", ".join(f"{_e(phase)} {count}" for phase, count in summary["phases"].items())
    out.print(f"wrote [bold]{_e(summary['output'])}[/bold]: {summary['ops']} ops ({phases})")
    out.print(f"loss {_e(summary['loss'])}, optimizer {_e(summary['optimizer'])} (lr {summary['lr']:g}); "
              f"{summary['trainable_parameters']} trainable parameters, {summary['parameters']:,} values "
              f"({format_bytes(summary['parameter_bytes'])}), optimizer state "
              f"{format_bytes(summary['optimizer_state_bytes'])}")
    inputs = ", ".join(f"{_e(n)} {'x'.join(map(str, s)) or 'scalar'}" for n, s in summary["inputs"].items())
    out.print(f"inputs: {inputs}; outputs: {summary['outputs']} (the loss, or a GAN's two, then the "
              f"per-parameter outputs)")


def print_remat(summary: dict) -> None:
    """`memsched remat`: the chosen plan, then every method tried."""
    out = console()
    lower = summary["lower_bound"]
    bound = f", proven floor +{lower / summary['base_cost'] - 1:.3%}" if lower and summary["base_cost"] else ""
    out.print(f"[bold]{_e(summary['method'])}[/bold] ({_e(summary['status'])}{bound}): peak "
              f"{format_bytes(summary['peak_bytes'])} within {format_bytes(summary['budget_bytes'])}, "
              f"{summary['recomputations']} recomputations, cost +{summary['overhead']:.3%} "
              f"in {summary['seconds']:.1f} s ({summary['nodes']} nodes)")
    table = Table(title="methods", title_justify="left")
    for col, justify in (("method", "left"), ("fits", "left"), ("peak", "right"), ("overhead", "right"),
                         ("status", "left"), ("seconds", "right")):
        table.add_column(col, justify=justify)
    for name, run in summary["methods"].items():
        table.add_row(_e(name), "yes" if run["fits"] else "no", format_bytes(run["peak_bytes"]),
                      f"+{run['overhead']:.3%}", _e(run["status"]), f"{run['seconds']:.2f}")
    out.print(table)


def print_tune(result: dict) -> None:
    """Per strategy set: the largest batch that fits and the fastest per sample."""
    out = console()
    table = Table(title=f"batch size search (fits in {format_bytes(result['capacity_bytes'])})", title_justify="left")
    for col, justify in (("strategies", "left"), ("largest batch", "right"), ("fastest batch", "right"),
                         ("time/sample", "right"), ("peak there", "right")):
        table.add_column(col, justify=justify)
    for name, largest in result["largest_batch"].items():
        best = result["best"].get(name)
        table.add_row(_e(name), "-" if largest is None else str(largest), str(best["batch"]) if best else "-",
                      format_seconds(best["time_per_sample_s"]) if best else "-",
                      format_bytes(best["peak_bytes"]) if best else "-")
    out.print(table)
    cut = [name for name, done in result.get("complete", {}).items() if not done]
    if cut:
        out.print(f"[yellow]the time limit ended the search for {_e(', '.join(cut))}: the largest batch shown "
                  f"there is the largest that fitted so far; give --time-limit more seconds[/yellow]")
    for name, best in result["best"].items():
        if best and best.get("measured") is None and "measured" in best:
            out.print(f"{_e(name)} at batch {best['batch']}: not measured (past the time limit)")
        if best and best.get("measured"):
            m = best["measured"]
            out.print(f"measured {_e(name)} at batch {best['batch']} on {_e(m['provider'])}: "
                      f"{format_seconds(m['time_per_sample_s'])} per sample "
                      f"(predicted {format_seconds(best['time_per_sample_s'])}), "
                      f"peak {format_bytes(m['peak_bytes'])} (planned {format_bytes(m['planned_peak_bytes'])})")
    overall = result["best_overall"]
    if overall:
        out.print(f"[bold]best predicted throughput: batch {overall['batch']} with {_e(overall['strategy'])} "
                  f"({format_seconds(overall['time_per_sample_s'])} per sample)[/bold]")
    else:
        out.print("[bold]no batch size fits[/bold]")
    if result.get("plot"):
        out.print(f"wrote plot: {_e(result['plot'])}")


def print_run(summary: dict) -> None:
    out = console()
    provider = _e(summary["provider"])
    if summary["fallback"]:
        provider += f" [yellow](asked for {_e(summary['requested_device'])}: {_e(summary['fallback'])})[/yellow]"
    out.print(f"ran [bold]{summary['steps']}[/bold] step(s) of {_e(summary['plan'])} on {provider}: "
              f"{summary['ops']} op runs per step, {summary['sessions']} ONNX Runtime "
              f"session{'' if summary['sessions'] == 1 else 's'}")
    table = Table(title_justify="left")
    for col in ("", "measured", "planned"):
        table.add_column(col, justify="right" if col else "left")
    measured, predicted = summary["measured"], summary["predicted"]
    for key, label in (("peak_bytes", "peak live bytes"), ("arena_bytes", "arena bytes")):
        table.add_row(label, f"{format_bytes(measured[key])} ({measured[key]:,} B)",
                      f"{format_bytes(predicted[key])} ({predicted[key]:,} B)")
    table.add_row("step time", format_seconds(measured["step_time_s"]),
                  format_seconds(predicted["step_time_s"])
                  + (f" ({_e(predicted['hardware'])} profile)" if predicted["hardware"] else ""))
    out.print(table)
    process = summary.get("process")
    if process and process["rss_growth_bytes"] is not None:
        out.print(f"process memory growth (RSS): {format_bytes(process['rss_growth_bytes'])} "
                  f"({process['rss_growth_bytes']:,} B) = arena {format_bytes(process['host_arena_bytes'])} + stores "
                  f"{format_bytes(process['store_bytes'])} + executor overhead "
                  f"{format_bytes(process['overhead_bytes'])}"
                  + (f", {format_bytes(process['file_growth_bytes'])} of it library code paged in"
                     if process.get("file_growth_bytes") else "")
                  + (" (with the check's reference run)" if process["includes_check"] else ""))
    elif process:
        out.print("process memory growth (RSS): unavailable here")
    device = (process or {}).get("device")
    if device:
        out.print(f"device memory growth: {format_bytes(device['growth_bytes'])} ({device['growth_bytes']:,} B) = "
                  f"arena {format_bytes(device['arena_bytes'])} + ONNX Runtime's CUDA workspace and the rest "
                  f"{format_bytes(device['overhead_bytes'])}")
        _print_device_accounting(out, device)
    for tier, nbytes in summary["swapped_bytes"].items():
        out.print(f"swapped out to {_e(tier)}: {format_bytes(nbytes)} per step")
    check = summary["check"]
    if check is not None:
        kind = "bit-identical" if check["bit_identical"] else f"max |diff| {check['max_abs_diff']:.3g}"
        out.print(f"check against a plain ONNX Runtime run ({check['steps']} step(s)): {_verdict(check)}, {kind}")
        given = check.get("given")
        if given is not None:
            out.print("check against the model as given (fused updates, split convolutions and micro-batches "
                      f"round differently): {_verdict(given)}, max |diff| {given['max_abs_diff']:.3g} "
                      f"(tolerance {given['tolerance']:g})")
        against = check.get("against")
        if against is not None:
            model = _e(against.get("model", "the model"))
            out.print(f"check against the step rebuilt from {model} (its own weights, the plan's "
                      f"training options): {_verdict(against)}, max |diff| {against['max_abs_diff']:.3g} "
                      f"(tolerance {against['tolerance']:g})")


def print_data_parallel_run(summary: dict, sync_batchnorm: bool) -> None:
    """A data-parallel run's summary (`run --workers N`): measured next to predicted, per worker."""
    measured, predicted = summary["measured"], summary["predicted"]
    print(f"ran {summary['steps']} step(s) of {summary['plan']} on {summary['workers']} workers "
          f"({summary['backend']}, {len(summary['buckets'])} gradient buckets)")
    print(f"{'':24}{'measured':>16}{'predicted':>16}")
    rows = (("peak bytes per worker", "peak_bytes", "{:,}"), ("step time (s)", "step_time_s", "{:.6f}"),
            ("all-reduce wait (s)", "allreduce_wait_s", "{:.6f}"), ("all-reduce time (s)", "allreduce_s", "{:.6f}"),
            ("overlap fraction", "overlap_fraction", "{:.3f}"))
    for label, key, form in rows:
        print(f"{label:24}{form.format(measured[key]):>16}{form.format(predicted[key]):>16}")
    if sync_batchnorm:
        print(f"BatchNorm on the whole batch: {summary['synchronised_batch_statistics']} per-channel statistics "
              f"averaged across the workers")
    print(f"predicted step without overlap: {predicted['step_no_overlap_s']:.6f} s (the cpu profile, "
          f"{predicted['interconnect']['bandwidth'] / 1e9:g} GB/s interconnect)")


def _print_device_accounting(out, device: dict) -> None:
    """The process's device memory against the three parts it accounts for (run --json's
    process.device.accounted)."""
    accounted = device.get("accounted")
    if not accounted:
        return
    fixed = accounted["fixed_overhead_bytes"]
    parts = (f"arena {format_bytes(accounted['arena_bytes'])} + pinned stores' device share 0 B + fixed overhead "
             + (format_bytes(fixed) if fixed is not None else f"unmeasured ({_e(accounted['fixed_overhead_source'])})"))
    measured = device.get("measured_total_bytes")
    total = format_bytes(measured) if measured is not None else "not measured"
    ratio = device.get("measured_over_accounted")
    out.print(f"process device memory: {total}; accounted: {parts}"
              + (f" = {format_bytes(accounted['total_bytes'])} ({ratio:.3f}x of it measured)" if ratio else ""))


def _verdict(check: dict) -> str:
    return "[green]passed[/green]" if check["passed"] else "[red]FAILED[/red]"


@contextmanager
def step_progress(total: int, enabled: bool):
    """A rich progress bar for multi-step runs; yields the callback the executor calls, or None."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn("steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(), transient=True) as progress:
        task = progress.add_task("steps", total=total)
        yield lambda done, _total: progress.update(task, completed=done)


@contextmanager
def train_progress(total: int, batch_size: int, enabled: bool):
    """A live bar for `memsched train` (epoch, step, loss, samples/s, time left); yields the
    callback the loop calls with each step's record, or None."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn("{task.fields[what]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console(), transient=True) as progress:
        task = progress.add_task("train", total=total, what="", loss="-", rate="-")
        seconds: list[float] = []

        def update(record: dict) -> None:
            seconds.append(record["seconds"])
            recent = seconds[-50:]
            progress.update(task, advance=1, what=f"epoch {record['epoch'] + 1}",
                            loss=f"{record['loss']:.4f}", rate=f"{batch_size * len(recent) / sum(recent):,.0f}")
        yield update


def print_train(summary: dict) -> None:
    out = console()
    if summary["steps"]:
        out.print(f"trained {summary['steps']} steps ({summary['epochs_done']} epochs) of {_e(summary['plan'])} on "
                  f"{_e(summary['provider'])}: {summary['samples_per_second']:,.0f} samples/s, final loss "
                  f"{summary['final_loss']:.4f}")
    else:
        out.print(f"nothing to train: the run had done its {summary['epochs_done']} epochs already")
    scored = [record for record in summary["validation"] if "val_loss" in record]
    for record in scored[-1:]:          # every epoch's is in --json
        accuracy = f", accuracy {record['val_accuracy']:.2%}" if "val_accuracy" in record else ""
        first = scored[0]
        was = f" (after epoch 1: {first['val_loss']:.4f})" if len(scored) > 1 else ""
        out.print(f"validation after epoch {record['epoch'] + 1}: loss {record['val_loss']:.4f}{accuracy}{was}")
    if summary["stopped"]:
        out.print("[yellow]stopped early[/yellow] (Ctrl-C) after the current step")
    for what, path in summary["written"].items():
        out.print(f"wrote {what}: {_e(path)}")


def print_doctor(report: dict) -> None:
    out = console()
    ort = report["onnxruntime"]
    out.print(f"ONNX Runtime {_e(ort['version'])} (CUDA build: {_e(ort['cuda_build'] or 'none')}); "
              f"providers: {_e(', '.join(ort['providers']))}")
    for gpu in report["gpus"]:
        out.print(f"GPU {gpu['index']}: {_e(gpu['name'])}, {format_bytes(gpu['memory_bytes'])}")
    if not report["gpus"]:
        out.print("GPU: none seen by the NVIDIA driver")
    libraries = _table("CUDA libraries the CUDA provider needs", "library", "found at")
    for name, path in report["libraries"].items():
        libraries.add_row(_e(name), _e(path) if path else "[red]not found[/red]")
    if report["libraries"]:
        out.print(libraries)
    if report["cuda_usable"]:
        memory = report["device_memory"]
        out.print(f"[green]CUDA is usable[/green]: a session runs on {_e(', '.join(report['session_providers']))}; "
                  f"device memory {format_bytes(memory['free_bytes'])} free of {format_bytes(memory['total_bytes'])}")
    else:
        out.print(f"[yellow]CUDA is not usable[/yellow]: {_e(report['reason'])}")
        out.print(f"fix: {_e(report['fix'])}")
    overhead = report.get("fixed_overhead") or {}
    if overhead.get("bytes") is not None:
        out.print(f"fixed device memory per process: {format_bytes(overhead['bytes'])} ({overhead['bytes']:,} B; "
                  f"CUDA context, cuDNN and cuBLAS handles, ONNX Runtime): a plan's process needs its arena plus "
                  f"this ({_e(overhead['source'])})")
    else:
        out.print(f"fixed device memory per process: not measured; {_e(overhead.get('reason') or 'no figure')}")
