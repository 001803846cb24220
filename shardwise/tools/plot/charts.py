"""The charts of ``shardwise plot``: one function per PNG, each returning the numbers it drew.

Drawn with matplotlib's headless Agg backend (the ``plot`` extra); the series come from
`shardwise.tools.plot.runs`. The pipeline timeline is the pipeline strategy's own drawing
(`shardwise.strategies.pipeline.observe.write_timeline`), redrawn from the events the run saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError
from shardwise.tools.plot import runs as read
from shardwise.tools.plot.runs import Run, Series

_SIZE = (8.0, 4.5)
_DPI = 120


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a one-line error naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("shardwise plot needs matplotlib: pip install 'shardwise[plot]'") from None
    return plt


def _save(fig: Any, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    pyplot().close(fig)
    return str(path)


def _unit(peak: float) -> tuple[float, str]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if peak >= size:
            return float(size), name
    return 1.0, "B"


def _amount(n: float) -> str:
    scale, unit = _unit(n)
    return f"{n / scale:.3g} {unit}"


def curves(runs: list[Run], path: Path) -> dict[str, dict[str, Series]]:
    """Training loss (solid) and validation loss (dashed, dots) against step, every run overlaid; a
    second panel with the other validation metrics when a run has any. Returns ``{run: {key: (x, y)}}``."""
    plt = pyplot()
    metric_keys = [k for r in runs for k in read.val_metrics(r)]
    metric_keys = list(dict.fromkeys(metric_keys))
    fig, axes = plt.subplots(1, 2 if metric_keys else 1, figsize=(12.0, 4.5) if metric_keys else _SIZE, squeeze=False)
    loss_ax = axes[0][0]
    drawn: dict[str, dict[str, Series]] = {}
    colors = plt.get_cmap("tab10")
    for i, run in enumerate(runs):
        color = colors(i % 10)
        width = max(1.2, 2.8 - 0.8 * i)  # earlier runs drawn wider: two runs with the same losses both show
        mine: dict[str, Series] = {}
        for key, style in (("train_loss", {"linestyle": "-"}), ("val_loss", {"linestyle": "--", "marker": "o"})):
            xs, ys = read.curve(run, key)
            if xs:
                mine[key] = (xs, ys)
                loss_ax.plot(xs, ys, color=color, linewidth=width, label=f"{run.label} {key.replace('_', ' ')}", **style)
        if metric_keys:
            for j, key in enumerate(read.val_metrics(run)):
                xs, ys = read.curve(run, key)
                mine[key] = (xs, ys)
                look: dict[str, Any] = {"linestyle": ["-", ":", "-."][j % 3], "linewidth": width, "marker": "o", "markersize": 2 + width}
                axes[0][1].plot(xs, ys, color=color, label=f"{run.label} {key.removeprefix('val_')}", **look)
        drawn[run.label] = mine
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title("training and validation loss", fontsize=10)
    if metric_keys:
        axes[0][1].set_xlabel("step")
        axes[0][1].set_title("validation metrics", fontsize=10)
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    _save(fig, path)
    return drawn


def throughput(runs: list[Run], path: Path) -> dict[str, Series]:
    """Samples per second against seconds of training, every run overlaid; its mean as a dotted line."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=_SIZE)
    colors = plt.get_cmap("tab10")
    drawn = {}
    for i, run in enumerate(runs):
        xs, ys = read.throughput(run)
        if not xs:
            continue
        drawn[run.label] = (xs, ys)
        # Each rate holds over its interval: a step from the interval's start to its end.
        ax.plot([0.0, *xs], [ys[0], *ys], color=colors(i % 10), drawstyle="steps-pre", label=run.label)
        mean = run.summary.get("samples_per_s")
        if isinstance(mean, (int, float)):
            ax.axhline(mean, color=colors(i % 10), linestyle=":", linewidth=1, label=f"{run.label}: whole run {mean:,.0f}/s")
    ax.set_xlabel("seconds since training started (the logged rates added up)")
    ax.set_ylabel("samples / s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput over each logging interval (rank 0's log)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return drawn


def memory(run: Run, figures: dict[str, dict[str, float]], path: Path) -> dict[str, dict[str, float]]:
    """Bytes per rank by kind, measured beside the formula's prediction, the ratio over each pair."""
    plt = pyplot()
    section = run.summary.get("memory_per_rank", {})
    kinds = list(figures)
    scale, unit = _unit(max(v for f in figures.values() for v in f.values()))
    fig, ax = plt.subplots(figsize=_SIZE)
    width = 0.38
    for offset, key, color in ((-width / 2, "measured", "tab:blue"), (width / 2, "predicted", "tab:orange")):
        xs = [i + offset for i, k in enumerate(kinds) if key in figures[k]]
        ys = [figures[k][key] / scale for k in kinds if key in figures[k]]
        ax.bar(xs, ys, width, color=color, label="measured" if key == "measured" else "predicted (formula)")
    for i, k in enumerate(kinds):
        f = figures[k]
        if "measured" in f and f.get("predicted"):
            ax.text(i, max(f.values()) / scale, f"x{f['measured'] / f['predicted']:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels(kinds)
    ax.set_ylabel(f"{unit} per rank")
    missing = [k for k in read.MEMORY_KINDS if k not in figures]
    what = f"{section.get('strategy', run.summary.get('strategy', '?'))}"
    if "stage" in section:
        what += f", ZeRO stage {section['stage']}, shard degree {section.get('shard_degree', '?')}"
    note = f"; not recorded: {', '.join(missing)}" if missing else ""
    ax.set_title(f"{run.label}: memory per rank, measured vs formula (ratio above each pair)\n{what}{note}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.margins(y=0.12)
    _save(fig, path)
    return figures


def comm(run: Run, figures: dict[str, dict[str, float]], path: Path) -> dict[str, dict[str, float]]:
    """Bytes sent and received per training step by each collective (``group/op``), rank 0."""
    plt = pyplot()
    names = sorted(figures, key=lambda n: figures[n]["sent"] + figures[n]["received"])
    scale, unit = _unit(max(max(f["sent"], f["received"]) for f in figures.values()))
    fig, ax = plt.subplots(figsize=(_SIZE[0], max(2.5, 1.2 + 0.55 * len(names))))
    h = 0.38
    ys = list(range(len(names)))
    for offset, key, color in ((h / 2, "sent", "tab:blue"), (-h / 2, "received", "tab:green")):
        ax.barh([y + offset for y in ys], [figures[n][key] / scale for n in names], h, color=color, label=key)
        for y, n in zip(ys, names, strict=True):  # the number beside each bar: a small one would not show
            if figures[n][key]:
                ax.text(figures[n][key] / scale, y + offset, f" {_amount(figures[n][key])}", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{n}  ({figures[n]['calls']:.3g} calls/step)" for n in names], fontsize=8)
    ax.set_xlabel(f"{unit} per training step")
    steps = run.summary.get("comm", {}).get("steps")
    ax.set_title(
        f"{run.label}: bytes per step by collective, rank 0\n(the run's traffic over its {steps} steps, evaluation and checkpoints included)", fontsize=9
    )
    ax.grid(True, axis="x", alpha=0.3)
    ax.margins(x=0.15)
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)
    return figures


def comm_ranks(run: Run, figures: dict[int, dict[str, dict[str, float]]], path: Path) -> dict[int, dict[str, dict[str, float]]]:
    """Bytes each rank sends and receives per training step, two bars per rank (sent, received),
    each stacked by collective (``group/op``): where the traffic of a pipeline or a parameter
    server is uneven, this shows which rank carries it."""
    plt = pyplot()
    ranks = sorted(figures)
    ops = sorted({op for per in figures.values() for op in per}, key=lambda op: -sum(figures[r].get(op, {}).get("sent", 0) for r in ranks))
    totals = [max(sum(v["sent"] for v in figures[r].values()), sum(v["received"] for v in figures[r].values())) for r in ranks]
    scale, unit = _unit(max(totals))
    colors = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(_SIZE[0] + 2.0, max(2.6, 1.4 + 0.7 * len(ranks))))
    h = 0.38
    for offset, key, hatch in ((h / 2, "sent", None), (-h / 2, "received", "//")):
        left = [0.0] * len(ranks)
        for j, op in enumerate(ops):
            widths = [figures[r].get(op, {}).get(key, 0.0) / scale for r in ranks]
            ys = [y + offset for y in range(len(ranks))]
            ax.barh(ys, widths, h, left=left, color=colors(j % 10), hatch=hatch, edgecolor="white", label=op if key == "sent" else None)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        for y, r in enumerate(ranks):
            amount = sum(v[key] for v in figures[r].values())
            ax.text(left[y], y + offset, f" {key} {_amount(amount)}", va="center", fontsize=7)
    ax.set_yticks(list(range(len(ranks))))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per training step (solid bar sent, hatched bar received)")
    ax.set_title(f"{run.label}: bytes per step per rank, by collective", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlim(0, max(totals) / scale * 1.3)  # room for the labels beside the bars
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="collective", title_fontsize=7)
    _save(fig, path)
    return figures


def breakdown(run: Run, figures: read.Breakdown, path: Path) -> read.Breakdown:
    """Each rank's step as one bar split into the profiler's parts (ms per step), the step time
    measured outside the profiler marked on it."""
    plt = pyplot()
    ranks = sorted(figures.per_rank)
    fig, ax = plt.subplots(figsize=(_SIZE[0] + 1.5, max(2.6, 1.4 + 0.5 * len(ranks))))
    colors = plt.get_cmap("tab10")
    left = [0.0] * len(ranks)
    for j, part in enumerate(figures.parts):
        widths = [figures.per_rank[r][part] * 1e3 for r in ranks]
        ax.barh(ranks, widths, left=left, height=0.6, color=colors(j % 10), label=part)
        for y, x0, w in zip(ranks, left, widths, strict=True):
            if w > 0.06 * max(sum(figures.per_rank[r].values()) * 1e3 for r in ranks):  # label the parts wide enough to hold it
                ax.text(x0 + w / 2, y, f"{w:.2g}", ha="center", va="center", fontsize=7, color="white")
        left = [x0 + w for x0, w in zip(left, widths, strict=True)]
    marked = [r for r in ranks if r in figures.measured]
    xs = [figures.measured[r] * 1e3 for r in marked]
    ax.vlines(xs, [r - 0.38 for r in marked], [r + 0.38 for r in marked], colors="black", linewidth=2, label="measured step")
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (mean over the profiled steps)")
    window = f"steps {figures.window[0]}-{figures.window[-1]}" if figures.window else "no step"
    ax.set_title(f"{run.label}: where a step goes, per rank (profiler, {window})", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    _save(fig, path)
    return figures


def timeline(events: list[tuple[int, int, str, float, float]], pp: int, schedule: str, path: Path) -> str:
    """The pipeline strategy's own timeline drawing, from the events the run saved."""
    pyplot()  # the one-line error of this command when matplotlib is missing
    from shardwise.strategies.pipeline.observe import write_timeline

    return write_timeline(str(path), events, pp, schedule)
