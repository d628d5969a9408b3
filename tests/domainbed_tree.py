"""A tiny DomainBed-style image tree for tests: root/<domain>/<class>/<image>.

`pattern="random"` writes random RGB images, alternately PNG and JPEG. `pattern="code"` writes
constant-colour PNGs whose colour encodes where the file lives (`code_colour`), so an example can be
recovered from a tensor exactly (PNG is lossless and an unresized eval transform is exact).
`corrupt` extra files have an image extension but garbage bytes; they are spread over the domains and
classes (file k goes to domains[k % D] / classes[k % C]).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def code_colour(domain: int, cls: int, i: int) -> tuple[int, int, int]:
    """The colour of file i of class `cls` in domain `domain` in a pattern="code" tree."""
    return 10 + 60 * domain, 10 + 60 * cls, 5 + 10 * i


def make_tree(root: str | Path, domains=("d0", "d1", "d2"), classes=("a", "b"), per_class: int = 6, size: int = 20,
              corrupt: int = 0, pattern: str = "random", seed: int = 0) -> Path:
    root = Path(root)
    rng = np.random.default_rng(seed)
    for di, domain in enumerate(domains):
        for ci, cls in enumerate(classes):
            folder = root / domain / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                if pattern == "code":
                    assert per_class <= 25
                    Image.new("RGB", (size, size), code_colour(di, ci, i)).save(folder / f"img{i:03d}.png")
                else:
                    pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                    ext = ".png" if i % 2 == 0 else ".jpg"
                    Image.fromarray(pixels).save(folder / f"img{i:03d}{ext}")
    for k in range(corrupt):
        folder = root / domains[k % len(domains)] / classes[k % len(classes)]
        ext = ".png" if k % 2 == 0 else ".jpg"
        (folder / f"corrupt{k:03d}{ext}").write_bytes(b"not an image " + rng.bytes(200))
    return root
