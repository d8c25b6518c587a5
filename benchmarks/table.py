"""The one table `python -m benchmarks` prints: a row per record, its headline figure and its ratio to
the anchor row it pairs with (the case's `match` fields equal; with --before, the same run)."""
from __future__ import annotations

from benchmarks.case_types import Case

DETAIL_KEYS = ("size", "model", "case", "shape", "kind", "seq", "seq_len", "batch", "concurrency",
               "long_prompt_share", "command_buffer", "tree")
COLUMNS = ("case", "row", "framework", "detail", "figure", "value", "peak GiB", "vs anchor")


def headline(case: Case, record: dict) -> tuple[str, float] | None:
    """The first of the case's headline figures that the record has."""
    for key in case.headline:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, value
    return None


def anchor_ratio(case: Case, record: dict, records: list[dict]) -> float | None:
    """The record's headline over its anchor's: the first anchor record with the same match fields
    and the same headline figure."""
    if record.get("anchor"):
        return None
    mine = headline(case, record)
    if mine is None:
        return None
    match = ("row",) if record.get("tree") else case.match
    for other in records:
        if not other.get("anchor") or any(other.get(k) != record.get(k) for k in match):
            continue
        theirs = headline(case, other)
        if theirs and theirs[0] == mine[0] and theirs[1]:
            return mine[1] / theirs[1]
    return None


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table_rows(case: Case, records: list[dict]) -> list[tuple[str, ...]]:
    rows = []
    for record in records:
        figure = headline(case, record)
        if figure is None and "error" not in record:
            continue  # a record with none of the case's figures (a plan, a probe): in {out}/{case}.jsonl
        detail = " ".join(str(record[k]) for k in DETAIL_KEYS if record.get(k) is not None)
        ratio = anchor_ratio(case, record, records)
        peak = record.get("peak_gib")
        rows.append((case.name, str(record.get("row", ""))[:64], str(record.get("framework", "")), detail[:40],
                     figure[0] if figure else "error", _number(figure[1]) if figure else record["error"][:60],
                     _number(peak) if isinstance(peak, (int, float)) else "",
                     f"{ratio:.2f}x" if ratio is not None else ("anchor" if record.get("anchor") else "")))
    return rows


def format_table(results: list[tuple[Case, list[dict]]]) -> str:
    """One table over every case run (plain text, columns padded)."""
    rows = [COLUMNS] + [row for case, records in results for row in table_rows(case, records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
