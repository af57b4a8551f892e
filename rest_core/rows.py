"""Row counts: the query sizes (tokens per pass) each per-machine kernel choice is timed at, and how a choice made
at those counts reads at the others."""
from __future__ import annotations

# row counts measured: every query size the cost curve is measured at (rest_core.cost.GRID), so each tree
# size the budget weighs runs a kernel timed at that very size; between two of them the times are
# interpolated (a kernel's cost can turn between neighbours: on a 2-vCPU AMD EPYC with AVX-512 the
# transposed product won at 2 rows and cost 50% more than oneDNN's at 3, so "the choice at 2" ran 3-row
# passes at 1.35x a one-token pass where 2 and 4 rows cost 1.10x and 0.97x)
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
MAX_ROWS = 64  # above this, the choice at 64 rows applies (prefill)


def row_neighbours(measured: list[int]) -> list[tuple[int, int]]:
    """Per row count 0..MAX_ROWS, the measured counts at or below and at or above it (the same count where it
    was measured; the nearest one at either end of the measured range)."""
    out = []
    for r in range(MAX_ROWS + 1):
        below = [m for m in measured if m <= r]
        above = [m for m in measured if m >= r]
        out.append((below[-1] if below else above[0], above[0] if above else below[-1]))
    return out


def row_ranges(rows: list[int]) -> str:
    """Row counts as runs: [1, 2, 3, 8, 9] -> '1-3, 8-9'."""
    if not rows:
        return "none"
    runs: list[list[int]] = []
    for r in sorted(rows):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
