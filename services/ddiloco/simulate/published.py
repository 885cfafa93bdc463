"""The published goodput figures the model is checked against.

Source: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training"
(arXiv 2604.21428). The seed figures (1.2M chips: 88% Decoupled DiLoCo with 8 learners,
27% data-parallel) are from the announcement; the full table is from a secondary summary
of the paper (per-chip mean time between interruptions of one year).
"""

from __future__ import annotations

CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)

# method -> goodput (fraction) at each entry of CHIPS
TABLE: dict[str, tuple[float, ...]] = {
    "dp": (0.72, 0.57, 0.38, 0.27, 0.18),
    "elastic-dp": (0.88, 0.80, 0.69, 0.58, 0.40),
    "ddiloco-m8": (0.98, 0.96, 0.94, 0.88, 0.80),
    "ddiloco-m16": (0.99, 0.98, 0.96, 0.93, 0.86),
}

# (row, chips) -> goodput: the primary figures
SEED: dict[tuple[str, int], float] = {
    ("ddiloco-m8", 1_200_000): 0.88,
    ("dp", 1_200_000): 0.27,
}

TOLERANCE = 0.03  # target: every predicted cell within 3 points


def split_row(row: str) -> tuple[str, int | None]:
    """'ddiloco-m16' -> ('ddiloco', 16); 'dp' -> ('dp', None)."""
    if row.startswith("ddiloco-m"):
        return "ddiloco", int(row.removeprefix("ddiloco-m"))
    return row, None


def published(row: str, chips: int) -> float | None:
    values = TABLE.get(row)
    if values is None or chips not in CHIPS:
        return None
    return values[CHIPS.index(chips)]
