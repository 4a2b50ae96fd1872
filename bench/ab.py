"""A/B measurement shared by the benchmarks: sides measured in turn within every repeat, and their table.

Machines here are shared and noisy, and their speed drifts: a comparison holds only between runs that saw the
same conditions, so every repeat measures every side, on the same inputs, and the table reports
min/median/max over the repeats with the ratio of the medians.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable


def alternate(
    sides: list[str],
    use: Callable[[str], None],
    measure: Callable[[random.Random], list[float]],
    rows: list[str],
    repeats: int,
    reverse_odd_repeats: bool = False,
) -> dict[str, dict[str, list[float]]]:
    """Each repeat: ``use(side)`` then ``measure(rng)`` -> one value per row, for every side in turn, all sides of a
    repeat on the same prompts (seeded by the repeat). Returns side -> row -> values.

    ``reverse_odd_repeats``: every other repeat takes the sides in reverse order (A B, B A, ...), for measurements
    where going first or second is itself an advantage (a server started right after another one stopped)."""
    results: dict[str, dict[str, list[float]]] = {side: {row: [] for row in rows} for side in sides}
    for repeat in range(repeats):
        for side in reversed(sides) if reverse_odd_repeats and repeat % 2 else sides:
            use(side)
            for row, value in zip(rows, measure(random.Random(repeat)), strict=True):
                results[side][row].append(value)
        print(f"  repeat {repeat + 1}/{repeats} done", flush=True)
    return results


def print_ab_table(results: dict[str, dict[str, list[float]]], rows: list[str], a: str, b: str) -> None:
    """One line per row: min/median/max of side ``a``, of side ``b``, and the a/b ratio of the medians."""
    print(f"\n{'':<36} {a + ' min/med/max':>24} {b + ' min/med/max':>24} {'ratio':>7}")
    for row in rows:
        cells = []
        for side in (a, b):
            v = results[side][row]
            cells.append(f"{min(v):7.1f} {statistics.median(v):7.1f} {max(v):7.1f}")
        ratio = statistics.median(results[a][row]) / statistics.median(results[b][row])
        print(f"{row:<36} {cells[0]:>24} {cells[1]:>24} {ratio:6.2f}x")
