"""Draws what `benchmarks/bench_pool.py` measured: each engine's KV memory over the trace, one
panel per setup, a line per model, each engine's burst windows shaded in its colour.

    python3 benchmarks/plot_pool.py DIR/bench_pool.json docs/pool_trace.png

Needs matplotlib, which the package's `plot` extra installs (`pip install -e '.[plot]'`, or
`pip install matplotlib`); run it where the JSON was copied to, not on the GPU machine or in
CI. The series are the samples where an engine's `physical_bytes` changed (sampled every
10 ms), drawn as steps; the dashed line is the static split's share of the KV memory. An
oracle run alone in turn draws each engine from its own start; a killed engine's line starts
again when it is back (what its dead process sampled died with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

COLOURS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:grey",
    "tab:olive",
    "tab:cyan",
)


def _label(engine: dict[str, Any]) -> str:
    model = engine.get("model")
    return f"{engine['engine']}: {model}" if model else f"engine {engine['engine']}"


def plot(results: dict[str, Any], path: Path) -> list[str]:
    """Draws `results` to `path`; returns the setups drawn, a panel each."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    settings = results["settings"]
    unit = settings["unit_name"]
    scale = float(1 << 30 if unit == "GiB" else 1 << 20)
    setups = {n: s for n, s in results["setups"].items() if s.get("engines")}
    if not setups:
        raise SystemExit("no setup in the JSON has engine results to draw")
    figure, axes = plt.subplots(
        len(setups), 1, figsize=(10, 2.6 * len(setups)), sharex=True, squeeze=False
    )
    end = max(b["end_s"] for b in results["trace"]["bursts"])
    for ax, (name, setup) in zip(axes[:, 0], setups.items(), strict=True):
        for burst in results["trace"]["bursts"]:
            colour = COLOURS[burst["engine"] % len(COLOURS)]
            ax.axvspan(burst["start_s"], burst["end_s"], color=colour, alpha=0.15, lw=0)
        count = len(setup["engines"])
        for engine in setup["engines"]:
            memory = engine["memory"]
            times = [t for t in memory["t"] if t >= -1.0]
            values = [
                b / scale for t, b in zip(memory["t"], memory["bytes"], strict=True) if t >= -1.0
            ]
            end = max(end, *times) if times else end
            ax.step(
                times,
                values,
                where="post",
                color=COLOURS[engine["engine"] % len(COLOURS)],
                # equal series (the static split's) nest
                lw=0.8 + 1.8 * (count - engine["engine"]) / count,
                label=_label(engine),
            )
        ax.axhline(settings["static_bytes"] / scale, color="grey", ls="--", lw=0.8)
        total = setup["total"]
        ttft = total["ttft_ms"]["p99"]
        extra = f", {setup['oracle_mode']}" if setup.get("oracle_mode") else ""
        ax.set_title(
            f"{name}{extra}: TTFT p99 {ttft:.0f} ms, {total['completed']}/{total['requests']} "
            "completed",
            fontsize=10,
            loc="left",
        )
        ax.set_ylabel(f"KV memory ({unit})")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel("seconds since the trace started (shaded: each engine's bursts)")
    axes[-1, 0].set_xlim(-1.0, end)
    shapes = results["environment"].get("shapes") or [results["environment"].get("shape", "")]
    figure.suptitle("; ".join(s.split(" (")[0] for s in shapes), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return list(setups)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="bench_pool.json")
    parser.add_argument("png", type=Path, help="where the figure goes")
    args = parser.parse_args(argv)
    drawn = plot(json.loads(args.json.read_text()), args.png)
    print(f"{args.png}: {', '.join(drawn)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
