"""PNG plots for reports (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def plot_recovery(stage: dict, path: Path) -> Path:
    """Distillation recovery: student perplexity and KL to the teacher against training tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = stage["curve"]
    tokens = [p["tokens"] for p in curve]
    fig, (ax_ppl, ax_kl) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax_ppl.plot(tokens, [p["ppl"] for p in curve], marker="o", label="student")
    teacher = (stage.get("teacher") or {}).get("ppl")
    if teacher:
        ax_ppl.axhline(teacher, color="gray", linestyle="--", label=f"teacher ({teacher:.2f})")
    ax_ppl.set(xlabel="distillation tokens", ylabel="perplexity (held-out)", yscale="log")
    ax_ppl.legend()
    ax_kl.plot(tokens, [p["kl"] for p in curve], marker="o", color="C1")
    ax_kl.set(xlabel="distillation tokens", ylabel="KL(teacher || student), nats/token")
    fig.suptitle("Recovery during distillation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
