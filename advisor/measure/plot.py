"""The sweep plot: SLO goodput and p99 latency against the offered request rate, per system."""

from __future__ import annotations

from pathlib import Path


def plot_sweep(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (goodput_ax, latency_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, body in results.items():
        runs = body.get("runs", [body])
        rates = [r["request_rate"] for r in runs]
        goodput_ax.plot(rates, [r["request_goodput"] or 0 for r in runs], marker="o", label=name)
        latency_ax.plot(rates, [r["p99_ttft_ms"] for r in runs], marker="o", label=f"{name} TTFT")
        latency_ax.plot(rates, [r["p99_e2el_ms"] for r in runs], marker="s", linestyle="--", label=f"{name} e2e")
        if body.get("knee_request_rate") is not None:
            goodput_ax.axvline(body["knee_request_rate"], linestyle=":", color="grey")
    goodput_ax.set(title="SLO goodput", xlabel="request rate (req/s)", ylabel="good requests/s")
    latency_ax.set(title="p99 latency", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    for ax in (goodput_ax, latency_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
