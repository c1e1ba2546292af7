"""Loss and CE curves from the runs' JSONL metrics, drawn to one PNG."""

from __future__ import annotations

from pathlib import Path

from blocktrain.errors import RunError
from blocktrain.train.metrics import read_jsonl


def plot_runs(runs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [(run, f) for run in runs for f in sorted((run / "metrics").glob("*.jsonl"))]
    if not files:
        raise RunError(f"no metrics found under {', '.join(str(r) for r in runs)}; train a run first")
    fig, (ax_loss, ax_ce) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, f in files:
        recs = read_jsonl(f)
        label = f"{run.name}/{f.stem}" if len(runs) > 1 else f.stem
        steps = [r["step"] for r in recs if "loss" in r and "event" not in r]
        ax_loss.plot(steps, [r["loss"] for r in recs if "loss" in r and "event" not in r], label=label)
        val_keys = sorted({k for r in recs for k in r if k.startswith("val_") and k.endswith("_ce")})
        for key in [*val_keys, "noised_ce"]:  # val_ce, val_<objective's reference>, and older runs' names
            pts = [(r["step"], r[key]) for r in recs if key in r and "step" in r]
            if pts:
                ax_ce.plot(*zip(*pts, strict=True), marker="." if key.startswith("val") else None, label=f"{label} {key}")
    ax_loss.set(title="training loss", xlabel="step", ylabel="nats")
    ax_ce.set(title="cross-entropy (noised_ce is leaky: monitoring only)", xlabel="step", ylabel="nats/byte")
    for ax in (ax_loss, ax_ce):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
