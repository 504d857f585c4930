"""PNG plots of bench results, one line per server: throughput vs concurrency, and TTFT and
ITL percentiles vs concurrency. matplotlib is the optional `bench` extra."""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from .figures import PERCENTILES, RunResult
from .report import labels_in_order

INSTALL_HINT = "--plot needs matplotlib: pip install 'switchyard[bench]'"
_STYLES = {50: "-", 90: "--", 99: ":"}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (the message is the one line to print)."""


def load_pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or PlotUnavailable."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def _series(results: Sequence[RunResult], label: str, value) -> tuple[list[int], list[float]]:
    points = sorted((r.concurrency, value(r)) for r in results if r.label == label and value(r) is not None)
    return [c for c, _ in points], [v for _, v in points]


def _axes(plt, title: str, ylabel: str):
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.set_title(title)
    axes.set_xlabel("concurrency")
    axes.set_ylabel(ylabel)
    axes.set_xscale("log", base=2)
    axes.grid(True, which="both", alpha=0.3)
    return figure, axes


def _save(plt, figure, axes, concurrencies: list[int], path: Path) -> Path:
    axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def write_plots(results: Sequence[RunResult], directory: str | Path) -> list[Path]:
    """Writes throughput.png, ttft.png and itl.png into `directory`; returns their paths."""
    plt = load_pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    labels = labels_in_order(results)
    concurrencies = sorted({r.concurrency for r in results})
    figure, axes = _axes(plt, "Output throughput", "output tokens/s")
    for label in labels:
        axes.plot(*_series(results, label, lambda r: r.output_tok_s), marker="o", label=label)
    written = [_save(plt, figure, axes, concurrencies, directory / "throughput.png")]
    for name, title, attribute in (("ttft", "Time to first token", "ttft_ms"), ("itl", "Inter-token latency", "itl_ms")):
        figure, axes = _axes(plt, title, "ms")
        for index, label in enumerate(labels):
            color = f"C{index % 10}"
            for q in PERCENTILES:
                xs, ys = _series(results, label, lambda r, a=attribute, q=q: getattr(r, a).get(f"p{q}"))
                axes.plot(xs, ys, _STYLES[q], marker="o", color=color, label=f"{label} p{q}")
        written.append(_save(plt, figure, axes, concurrencies, directory / f"{name}.png"))
    return written
