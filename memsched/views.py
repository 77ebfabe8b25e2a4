"""Terminal renderings of library results (rich tables). The CLI calls these to print."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .units import format_bytes


def console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def print_inspect(summary: dict) -> None:
    out = console()
    out.print(f"[bold]{summary['graph']}[/bold]: {summary['ops']} ops, {summary['tensors']} tensors, "
              f"{summary['parameters']:,} parameters ({format_bytes(summary['parameter_bytes'])})")
    out.print(f"peak (default order): [bold]{format_bytes(summary['peak_bytes'])}[/bold] "
              f"({summary['peak_bytes']:,} B) at step {summary['peak_step']} ({summary['peak_op']})")
    by_kind = ", ".join(f"{k} {format_bytes(v)}" for k, v in summary["peak_by_kind"].items())
    out.print(f"at the peak: {by_kind}")

    ops = Table(title="ops by type", title_justify="left")
    ops.add_column("op type")
    ops.add_column("count", justify="right")
    for op_type, count in summary["op_types"].items():
        ops.add_row(op_type, str(count))
    out.print(ops)

    largest = Table(title="largest tensors", title_justify="left")
    for col, justify in (("tensor", "left"), ("shape", "left"), ("dtype", "left"), ("kind", "left"),
                         ("bytes", "right")):
        largest.add_column(col, justify=justify)
    for t in summary["largest_tensors"]:
        largest.add_row(t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"], t["kind"],
                        format_bytes(t["bytes"]))
    out.print(largest)


def print_train_graph(summary: dict) -> None:
    out = console()
    phases = ", ".join(f"{phase} {count}" for phase, count in summary["phases"].items())
    out.print(f"wrote [bold]{summary['output']}[/bold]: {summary['ops']} ops ({phases})")
    out.print(f"loss {summary['loss']}, optimizer {summary['optimizer']} (lr {summary['lr']:g}); "
              f"{summary['trainable_parameters']} trainable parameters, {summary['parameters']:,} values "
              f"({format_bytes(summary['parameter_bytes'])}), optimizer state "
              f"{format_bytes(summary['optimizer_state_bytes'])}")
    inputs = ", ".join(f"{n} {'x'.join(map(str, s)) or 'scalar'}" for n, s in summary["inputs"].items())
    out.print(f"inputs: {inputs}; outputs: loss + {summary['outputs'] - 1} per-parameter outputs")
