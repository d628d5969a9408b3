"""A miniature WILDS camelyon17_v1.0 tree for tests: metadata.csv + PNG patches for centres 0-4.

The label is learnable from colour (tumour patches are reddish, normal ones bluish, with a little
per-patch noise), so accuracies are meaningful. Centres 0, 3, 4 hold `train_per_center` patches with
split 0 and `id_val_per_center` with split 1; centres 1 (val) and 2 (test) hold `eval_per_center`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image


def make_camelyon(root: str | Path, train_per_center: int = 16, id_val_per_center: int = 4, eval_per_center: int = 12,
                  size: int = 16, seed: int = 0) -> Path:
    """Write <root>/camelyon17_v1.0/{metadata.csv, patches/...}; returns root."""
    root = Path(root)
    base = root / "camelyon17_v1.0"
    rng = np.random.default_rng(seed)
    rows = []
    for center in range(5):
        counts = [(0, train_per_center), (1, id_val_per_center)] if center in (0, 3, 4) else [(0, eval_per_center)]
        for split, count in counts:
            for i in range(count):
                patient, node = f"{10 * center + split:03d}", i % 2
                tumor = i % 2 if center != 2 else (i // 2) % 2
                x, y = 100 * i + split, 7 * center
                slide = 2 * center + node
                colour = np.array([200, 60, 60] if tumor else [60, 60, 200], dtype=np.int16)
                pixels = np.clip(colour + rng.integers(-30, 31, (size, size, 3)) + 10 * center, 0, 255).astype(np.uint8)
                folder = base / "patches" / f"patient_{patient}_node_{node}"
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(folder / f"patch_patient_{patient}_node_{node}_x_{x}_y_{y}.png")
                rows.append({"patient": patient, "node": node, "x_coord": x, "y_coord": y, "tumor": tumor,
                             "slide": slide, "center": center, "split": split})
    with open(base / "metadata.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["", *rows[0].keys()])
        for i, row in enumerate(rows):
            writer.writerow([i, *row.values()])
    return root
