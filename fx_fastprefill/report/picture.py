"""A picture of the cut: the layers in order, the boundary, what is gathered there, the reduced region.

Drawn with matplotlib (the optional ``picture`` extra) so that it needs no system binary; a
missing matplotlib raises :class:`PictureUnavailable` and the caller prints text instead.
"""

from __future__ import annotations

from pathlib import Path

from .report import FastPrefillReport

FULL_COLOR = "#c9d6e8"
REDUCED_COLOR = "#a8dba8"
KV_FULL_COLOR = "#f3d9a4"


class PictureUnavailable(RuntimeError):
    """matplotlib is not installed."""


def draw_cut(report: FastPrefillReport, path: str | Path, title: str = "") -> Path:
    """Write the picture to ``path``; the format follows the suffix (.svg or .png)."""
    path = Path(path)
    if path.suffix.lower() not in (".svg", ".png"):
        raise ValueError(f"picture path must end in .svg or .png, got {str(path)!r}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text: searchable, diffable
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
    except ImportError as e:
        raise PictureUnavailable("drawing the cut needs matplotlib: pip install 'fx-fastprefill[picture]'") from e

    layers = report.attention_layers
    n = max(len(layers), 1)
    reduced = set(report.reduced_layers)
    eligible = set(report.eligible_layers)
    own_kv = {a.layer for a in layers if a.kv_source is None}
    index = {a.layer: i for i, a in enumerate(layers)}
    width = max(8.0, 0.9 * n + 2.0)
    fig, ax = plt.subplots(figsize=(width, 4.8 + 0.22 * len(report.gathered)))
    ax.set_xlim(-0.8, n + 0.2)
    ax.set_ylim(-2.2 - 0.3 * len(report.gathered), 3.2)
    ax.axis("off")

    for i, a in enumerate(layers):
        in_reduced = a.layer in reduced
        color = REDUCED_COLOR if in_reduced else FULL_COLOR
        ax.add_patch(
            Rectangle(
                (i, 0), 0.8, 1.2, facecolor=color, edgecolor="black", linewidth=2.0 if a.layer in eligible else 0.6
            )
        )
        if in_reduced and a.layer in own_kv:
            # Its K/V are computed on all rows, its queries and MLP on the logits rows.
            ax.add_patch(Rectangle((i, 0.9), 0.8, 0.3, facecolor=KV_FULL_COLOR, edgecolor="black", linewidth=0.6))
            ax.text(i + 0.4, 1.05, "K/V: T", ha="center", va="center", fontsize=6)
        label = a.layer if len(a.layer) <= 12 else "…" + a.layer[-11:]
        ax.text(i + 0.4, -0.15, label, ha="center", va="top", fontsize=7, rotation=45 if n > 8 else 0)
        ax.text(i + 0.4, 0.45, "R" if in_reduced else "T", ha="center", va="center", fontsize=11, weight="bold")
        if a.sliding_window:
            ax.text(i + 0.4, 0.15, f"w{a.sliding_window}", ha="center", va="center", fontsize=6)
        if a.kv_source in index:
            j = index[a.kv_source]
            ax.add_patch(
                FancyArrowPatch(
                    (j + 0.4, 1.25),
                    (i + 0.4, 1.25),
                    connectionstyle=f"arc3,rad=-{min(0.5, 0.1 + 0.04 * (i - j))}",
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color="#8a5a00",
                    linewidth=0.8,
                )
            )

    if report.cut and reduced:
        first = min(index[name] for name in reduced if name in index)
        x = first - 0.1
        ax.plot([x, x], [-0.9, 2.9], linestyle="--", color="#b00000", linewidth=1.5)
        ax.text(
            x,
            3.0,
            f"boundary: gather {report.row_selection or 'the logits rows'}",
            ha="center",
            va="bottom",
            fontsize=8,
            color="#b00000",
        )
        tx = min(x + 0.05, max(-0.7, n - 6.5))  # keep long names inside the figure
        ax.text(tx, -1.0, "gathered here (T -> R rows):", ha="left", va="top", fontsize=8, weight="bold")
        for k, g in enumerate(report.gathered):
            ax.text(tx, -1.3 - 0.3 * k, f"{g.name}  {g.shape}", ha="left", va="top", fontsize=7, family="monospace")
    elif not report.cut:
        ax.text(
            n / 2, 2.6, f"not cut: {report.reason}", ha="center", va="center", fontsize=8, color="#b00000", wrap=True
        )

    headline = title or "fx_fastprefill cut"
    headline += (
        f" — {100 * report.flops_removed_fraction:.1f}% of prefill FLOPs removed at prompt length {report.prompt_len}"
    )
    ax.set_title(headline, fontsize=10)
    ax.legend(
        handles=[
            Patch(facecolor=FULL_COLOR, edgecolor="black", label="full region: all T rows"),
            Patch(facecolor=REDUCED_COLOR, edgecolor="black", label="reduced region: R logits rows"),
            Patch(facecolor=KV_FULL_COLOR, edgecolor="black", label="K/V still on all rows"),
            Patch(
                facecolor="white",
                edgecolor="black",
                linewidth=1.2,
                label="thick border: eligible (trailing KV-sharing run)",
            ),
            Patch(facecolor="white", edgecolor="#8a5a00", label="arrow: reads the K/V of"),
        ],
        loc="lower left",
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
