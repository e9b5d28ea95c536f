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

    results, log = report.in_rounds(["x", "y"], 3, run)
    assert calls == [("x", 0), ("y", 0), ("y", 1), ("x", 1), ("x", 2), ("y", 2)]
    assert results == {"x": [{"value": 1, "round": 0}, {"value": 14, "round": 1},
                             {"value": 25, "round": 2}],
                       "y": [{"value": 2, "round": 0}, {"value": 13, "round": 1},
                             {"value": 26, "round": 2}]}
    assert [entry["order"] for entry in log] == [["x", "y"], ["y", "x"], ["x", "y"]]


def test_each_round_records_the_load_average_and_what_its_start_measured(monkeypatch) -> None:
    loads = iter([1.5, 2.0, 2.5, 0.5, 0.75, 1.0])
    monkeypatch.setattr(report.os, "getloadavg", lambda: (next(loads), 9.0, 9.0))
    seen = []
    results, log = report.in_rounds(
        ["x", "y"], 2, lambda name, r: {"value": r},
        at_round_start=lambda r: {"loopback": 10 * r},
        after_run=lambda results, log: seen.append(sum(map(len, results.values()))))
    assert log == [{"round": 0, "order": ["x", "y"], "load_1m_before": 1.5, "loopback": 0,
                    "load_1m_after": 2.5},
                   {"round": 1, "order": ["y", "x"], "load_1m_before": 0.5, "loopback": 10,
                    "load_1m_after": 1.0}]
    assert seen == [1, 2, 3, 4]  # after every run: a long bench keeps what it measured


def test_spread_is_the_median_and_the_extremes_of_what_was_measured() -> None:
    assert report.spread([3.0, 1.0, None, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert report.spread([None]) == {"median": None, "min": None, "max": None}


def test_per_round_follows_dotted_paths_and_skips_what_a_round_lacks() -> None:
    runs = [{"stall_s": {"median": 1.0}, "ok": True}, {"stall_s": {"median": 3.0}},
            {"error": "crashed"}]
    assert report.per_round(runs, {"stall": "stall_s.median", "flag": "ok"}) == {
        "stall": {"median": 2.0, "min": 1.0, "max": 3.0},
        "flag": {"median": None, "min": None, "max": None}}  # a bool is not a figure


def test_over_rounds_gives_each_figure_s_spread_and_every_round() -> None:
    runs = [{"step_s": 0.2, "stall_s": {"median": 1.0}}, {"step_s": 0.4, "stall_s": {}},
            {"step_s": 0.3, "error": "crashed"}]
    summary = report.over_rounds(runs, {"step_s": "step_s", "stall": "stall_s.median"})
    assert summary == {"step_s": {"median": 0.3, "min": 0.2, "max": 0.4},
                       "stall": {"median": 1.0, "min": 1.0, "max": 1.0}, "rounds": runs}


def test_paired_ratio_pairs_the_runs_of_a_round_and_skips_what_it_cannot_divide() -> None:
    ours = [{"rate": 2.0}, {"rate": 3.0}, {"rate": None}, {"rate": 1.0}]
    theirs = [{"rate": 1.0}, {"rate": 2.0}, {"rate": 1.0}, {"rate": 0.0}]
    assert report.paired_ratio(ours, theirs, "rate") == {
        "median": 1.75, "min": 1.5, "max": 2.0, "per_round": [2.0, 1.5, None, None]}
