"""Draw docs/_static/train_step.svg: the TP + SP training step's times.

Plain Python, no plotting library. The figures are those of
benchmarks/results/train_step_2cpu-gloo-loopback-2gbit_2026-12-02_5ce2715.md
(medians, ms); update them together with docs/performance.md, then run::

    python docs/_static/make_chart.py
"""

from __future__ import annotations

import pathlib

# link -> (unfused eager, eagertp, bound), ms
STEP = {
    "loopback": (346.9, 330.5, 285.1),
    "2 Gbit/s (shaped)": (503.3, 359.6, 280.6),
}
SERIES = (("unfused eager", "#9e9e9e"), ("eagertp", "#2e7d32"), ("bound (no communication)", "#90caf9"))

W, BAR, GAP, LEFT, TOP, SCALE = 640, 22, 30, 150, 40, 0.8  # SCALE: px per ms


def svg() -> str:
    rows = []
    y = TOP
    for link, values in STEP.items():
        rows.append(f'<text x="{LEFT - 10}" y="{y + 1.5 * BAR + 4}" text-anchor="end">{link}</text>')
        for (name, colour), v in zip(SERIES, values):
            rows.append(f'<rect x="{LEFT}" y="{y}" width="{v * SCALE:.1f}" height="{BAR - 4}" fill="{colour}"/>')
            rows.append(f'<text x="{LEFT + v * SCALE + 6:.1f}" y="{y + BAR - 9}">{v:.1f} ms</text>')
            y += BAR
        y += GAP
    legend_y = y
    for i, (name, colour) in enumerate(SERIES):
        x = LEFT + i * 170
        rows.append(f'<rect x="{x}" y="{legend_y}" width="12" height="12" fill="{colour}"/>')
        rows.append(f'<text x="{x + 18}" y="{legend_y + 11}">{name}</text>')
    height = legend_y + 30
    title = "TP + SP training step, 2 gloo ranks on 2 CPU cores (median ms, lower is better)"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" '
        f'font-family="sans-serif" font-size="12">\n'
        f'<rect width="100%" height="100%" fill="white"/>\n'
        f'<text x="10" y="20" font-size="13" font-weight="bold">{title}</text>\n'
        + "\n".join(rows)
        + "\n</svg>\n"
    )


if __name__ == "__main__":
    (pathlib.Path(__file__).resolve().parent / "train_step.svg").write_text(svg())
