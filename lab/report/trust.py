"""When a number on a page should not be taken at face value: timings whose calls spread too widely for their
median to stand for them, and a model whose error on data it was not fitted to is large. Each function returns
sentences (empty when all is well) that ``app_pages._ui.trust_warning`` shows as one warning."""
from __future__ import annotations

import math

import pandas as pd

SPREAD_LIMIT = 3.0  # slowest call / median: past this a median hides calls that took several times as long
HOLDOUT_LIMIT = 0.25  # a model's median relative error on held-out data past which its predictions are rough


def spread_problems(table: pd.DataFrame, median: str, slowest: str, names: list[str], unit: str = "ms",
                    limit: float = SPREAD_LIMIT, shown: int = 3) -> list[str]:
    """One sentence per row of ``table`` whose ``slowest`` figure is more than ``limit`` times its ``median`` (the
    ``shown`` worst, then how many more), each row named by its ``names`` columns: ``"torch, batch 8, context
    1024: slowest call 75× the median (12.1 ms vs 0.16 ms)"``."""
    if table.empty or median not in table or slowest not in table:
        return []
    ratio = table[slowest] / table[median].where(table[median] > 0)
    wide = table.assign(_ratio=ratio)[ratio > limit].sort_values("_ratio", ascending=False)
    problems = []
    for _, row in wide.head(shown).iterrows():
        name = ", ".join(f"{column} {row[column]}" if column != names[0] else str(row[column]) for column in names
                         if column in row)
        problems.append(f"{name}: slowest call {row['_ratio']:,.0f}× the median ({row[slowest]:,.3g} {unit} vs "
                        f"{row[median]:,.3g} {unit}); the machine was busy or the first call paid a warm-up, so "
                        "rerun with more repeats before trusting it")
    if len(wide) > shown:
        problems.append(f"{len(wide) - shown} more row(s) spread past {limit:g}× their median")
    return problems


def holdout_problem(error: float, what: str = "the profile", limit: float = HOLDOUT_LIMIT) -> list[str]:
    """A sentence when ``what``'s median relative error on held-out data (``error``, a fraction) is past ``limit``
    (or unknown): its predictions are that far off on data it was not fitted to."""
    if error is None or (isinstance(error, float) and math.isnan(error)):
        return [f"{what} has no held-out error: how far off its predictions are on unseen data is unknown"]
    if error > limit:
        return [f"{what} is {error:.0%} off (median) on held-out data it was not fitted to, past {limit:.0%}: its "
                "predictions are rough; calibrate on a larger grid or on a quieter machine"]
    return []


def table_problems(table: pd.DataFrame) -> list[str]:
    """What makes a results table's numbers untrustworthy, from the columns it has: kernel timings whose slowest
    call is far from their median (``spread_problems``) or that record a median alone (no spread to judge it by),
    and a profile's held-out error (a ``metric`` row ``holdout_median_rel_error``, ``holdout_problem``)."""
    problems = []
    if "median_ms" in table:
        names = [column for column in ("kernel", "backend", "batch", "context") if column in table]
        if "max_ms" in table:
            problems += spread_problems(table, "median_ms", "max_ms", names)
        else:
            problems.append("timings recorded as medians alone (no fastest or slowest call): their spread is unknown, "
                            "so a disturbed measurement cannot be told apart; rerun the command to record it")
    if {"metric", "rel_error"} <= set(table.columns):
        holdout = table[table["metric"] == "holdout_median_rel_error"]["rel_error"].dropna()
        if len(holdout):
            problems += holdout_problem(float(holdout.max()), "the profile")
    return problems
