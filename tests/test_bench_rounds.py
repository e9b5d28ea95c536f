"""The helpers every bench shares for rounds: the alternating order and the spread."""

from __future__ import annotations

from ftsystem.measure import report


def test_the_order_of_the_systems_reverses_every_other_round() -> None:
    assert report.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert report.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    assert report.round_order(["a", "b", "c"], 2) == ["a", "b", "c"]


def test_in_rounds_runs_every_system_each_round_in_the_alternating_order() -> None:
    calls = []

    def run(name: str, r: int) -> dict:
        calls.append((name, r))
        return {"value": 10 * r + len(calls)}

    results = report.in_rounds(["x", "y"], 3, run)
    assert calls == [("x", 0), ("y", 0), ("y", 1), ("x", 1), ("x", 2), ("y", 2)]
    assert results == {"x": [{"value": 1}, {"value": 14}, {"value": 25}],
                       "y": [{"value": 2}, {"value": 13}, {"value": 26}]}


def test_spread_is_the_median_and_the_extremes_of_what_was_measured() -> None:
    assert report.spread([3.0, 1.0, None, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert report.spread([None]) == {"median": None, "min": None, "max": None}


def test_per_round_follows_dotted_paths_and_skips_what_a_round_lacks() -> None:
    runs = [{"stall_s": {"median": 1.0}, "ok": True}, {"stall_s": {"median": 3.0}},
            {"error": "crashed"}]
    assert report.per_round(runs, {"stall": "stall_s.median", "flag": "ok"}) == {
        "stall": {"median": 2.0, "min": 1.0, "max": 3.0},
        "flag": {"median": None, "min": None, "max": None}}  # a bool is not a figure
