"""Figures: a matplotlib figure without pyplot's global state, and its PNG file (the `plots` extra)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from .extras import require


def new_figure(width: float, height: float):
    require("matplotlib", "plots", "plotting")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Write ``fig`` as a 256-colour PNG, through a temporary file and a rename. A plot has few colours: the
    palette image reads the same and is a quarter of the size of matplotlib's RGBA one."""
    from PIL import Image  # matplotlib's own dependency

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    image = Image.open(buf).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    tmp = path.with_name(path.name + ".tmp")
    image.save(tmp, format="PNG", optimize=True)
    tmp.replace(path)
    return path
