"""bench.replicas: the router's placement rule, its flags, and one tiny comparison on a real
cluster (two replica processes, with and without the shared tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replicas import (
    POPULATIONS,
    Routing,
    RunOutcome,
    build_parser,
    compare,
    figures,
    main,
    route,
    run_benchmark,
    summarize,
    summary,
)
from models.serving_loop import RequestResult
from tests.redis_cluster import LocalRedisCluster


def test_route_is_a_function_of_seed_user_and_round() -> None:
    first = [route(3, u, r, u % 2 if r else None, 2, 0.5) for u in range(50) for r in range(4)]
    again = [route(3, u, r, u % 2 if r else None, 2, 0.5) for u in range(50) for r in range(4)]
    assert first == again
    other_seed = [route(4, u, r, u % 2 if r else None, 2, 0.5) for u in range(50)
                  for r in range(4)]
    assert first != other_seed


def test_route_moves_with_the_move_probability() -> None:
    for previous in range(3):
        assert all(route(0, u, 1, previous, 3, 1.0) != previous for u in range(200))
        assert all(route(0, u, 1, previous, 3, 0.0) == previous for u in range(200))
    moved = sum(route(0, u, 1, 0, 2, 0.8) != 0 for u in range(2000))
    assert 1500 < moved < 1700  # 0.8 of 2000, within about five standard deviations
    firsts = {route(0, u, 0, None, 3, 0.8) for u in range(100)}
    assert firsts == {0, 1, 2}


@pytest.mark.parametrize(("flags", "named"), [
    (["--move-probability", "1.5"], "--move-probability"),
    (["--rates", "0.5,0.5"], "--rates"),
    (["--rates", "-1"], "--rates"),
    (["--replicas", "1"], "--replicas"),
    (["--model", "huge"], "--model"),
    (["--gpu-blocks", "4"], "--gpu-blocks"),
    (["--redis-maxmemory", "lots"], "--redis-maxmemory"),
    (["--machine", "a b"], "--machine"),
    (["--repeats", "0"], "--repeats"),
    (["--warmup-requests", "-1"], "--warmup-requests"),
    (["--warmup-requests", "36", "--users", "12", "--rounds", "3"], "--warmup-requests"),
])
def test_bad_flags_fail_on_one_line_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert named in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_routing_remembers_the_rounds_that_moved() -> None:
    routing = Routing(seed=0, replicas=2, move_probability=1.0)
    first = routing.place(0, 0)
    assert routing.place(0, 1) != first and routing.place(1, 0) in (0, 1)
    assert routing.moved == {(0, 1)} and routing.moves == 1
    stay = Routing(seed=0, replicas=2, move_probability=0.0)
    assert stay.place(0, 0) == stay.place(0, 1) and stay.moves == 0


def _outcome(ttfts: dict[str, float], moved: set[str]) -> RunOutcome:
    results = tuple((0, RequestResult(request_id=rid, prompt_tokens=10, arrival=1.0,
                                      first_token=1.0 + t, recomputed_tokens=10))
                    for rid, t in ttfts.items())
    return RunOutcome(results=results, seconds=2.0, counters=({},), moves=len(moved),
                      order=tuple(ttfts), moved=frozenset(moved))


def test_ttft_is_reported_over_the_moved_rounds_the_window_and_every_request() -> None:
    # Two users' first rounds are the warm-up (slow: they compute their history); u0-r1
    # moved, u1-r1 stayed.
    outcome = _outcome({"u0-r0": 9.0, "u1-r0": 8.0, "u0-r1": 0.5, "u1-r1": 1.5},
                       moved={"u0-r1"})
    row = summarize(outcome, offered_rps=1.0, offered_input_tps=10.0, warmup=2)
    t = row["ttft"]
    assert set(t) == set(POPULATIONS)
    assert t["moved"] == {"count": 1, "p50_s": pytest.approx(0.5), "p99_s": pytest.approx(0.5)}
    assert t["window"]["count"] == 2 and t["window"]["p99_s"] == pytest.approx(1.5)
    assert t["all"]["count"] == 4 and t["all"]["p99_s"] == pytest.approx(9.0)
    assert row["ttft_p99_s"] == pytest.approx(9.0)  # the all-requests figure, as before
    assert [r[0] for r in row["requests_ttft"]] == ["u0-r0", "u1-r0", "u0-r1", "u1-r1"]
    assert [r[2] for r in row["requests_ttft"]] == [False, False, True, False]
    none = summarize(outcome, offered_rps=1.0, offered_input_tps=10.0, warmup=0)["ttft"]
    assert none["window"] == none["all"]


def test_compare_orders_and_bounds_the_goodput_ratio() -> None:
    def g(index: int | None, rps: float | None, status: str) -> dict[str, object]:
        return {"rate_index": index, "requests_per_s": rps, "status": status}

    assert compare(g(2, 4.0, "below_next"), g(1, 2.0, "below_next")) == {
        "order": "shared", "ratio": 2.0, "lower_bound": False}
    assert compare(g(3, 8.0, "every_rate"), g(1, 2.0, "below_next"))["lower_bound"]
    both_top = compare(g(3, 8.0, "every_rate"), g(3, 8.0, "every_rate"))
    assert both_top == {"order": "tie", "ratio": None, "lower_bound": False}
    lost = compare(g(None, None, "never_met"), g(0, 1.0, "below_next"))
    assert lost["order"] == "local" and lost["ratio"] is None


def test_a_ratio_only_one_repeat_in_three_pins_is_no_figure() -> None:
    def table(s: int | None, loc: int | None) -> dict[str, dict[str, object]]:
        def one(i: int | None) -> dict[str, object]:
            return {"rate_index": i, "requests_per_s": None if i is None else 2.0 ** i,
                    "status": "never_met" if i is None else "below_next"}
        return {"shared": one(s), "local": one(loc)}

    doc: dict[str, object] = {
        "prefill_tok_per_s": 1.0, "capacity_requests_per_s": 8.0, "replicas": 2,
        "modes": ["shared", "local"], "rates": [],
        "repeats": [{"goodput": {p: t for p in POPULATIONS}, "runs": {}}
                    for t in (table(None, 0), table(None, None), table(1, 0))]}
    doc["summary"] = summary(doc)
    vs = doc["summary"]["goodput"]["moved"]["shared_vs_local"]  # type: ignore[index]
    assert (vs["shared_higher"], vs["tied"], vs["local_higher"]) == (1, 1, 1)
    assert vs["ratio"]["n"] == 1
    assert "goodput_shared_vs_local" not in figures(doc)
    doc["repeats"] = [{"goodput": {p: table(1, 0) for p in POPULATIONS}, "runs": {}}] * 3
    doc["summary"] = summary(doc)
    assert figures(doc)["goodput_shared_vs_local"]["value"] == 2.0


TINY = ["--model", "tiny", "--layers", "2", "--vocab", "512", "--dtype", "float32",
        "--users", "8", "--rounds", "3", "--system-tokens", "32", "--history-tokens", "64",
        "--question-tokens", "16", "--answer-tokens", "4", "--block-size", "16",
        # One request's worth of GPU: admitting the next request evicts (and so publishes)
        # the previous one's blocks before its user's next round reaches the other replica.
        "--gpu-blocks", "11", "--host-blocks", "64", "--disk-blocks", "256",
        "--move-probability", "1", "--rates", "0.05", "--no-cost-aware",
        "--skip-fetch-probe", "--progress", "never", "--slo-ttft-p99", "30",
        "--repeats", "2"]


def test_a_moved_user_is_served_from_the_shared_tier_and_recomputes_without_it(
    redis_cluster: LocalRedisCluster, tmp_path: Path,
) -> None:
    argv = [*TINY, "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "disk")]
    path = run_benchmark(build_parser().parse_args(argv), argv, redis_cluster)
    doc = json.loads(path.read_text())
    assert doc["bench"] == "replicas" and doc["machine"] == "cpu" and doc["commit"]
    assert path.name.startswith("replicas-cpu-")
    assert [r["seed"] for r in doc["repeats"]] == [0, 1]
    assert doc["warmup_requests"] == 8 and doc["headline"] == "moved"
    first, second = doc["repeats"]
    # Each repeat its own seeded placement, the same for both configurations (the arrival
    # order of later rounds follows the answers, so it may differ).
    placed = [{(r[0], r[1]) for r in rep["runs"][m][0]["requests_ttft"]}
              for rep in doc["repeats"] for m in ("shared", "local")]
    assert placed[0] == placed[1] and placed[2] == placed[3] and placed[0] != placed[2]
    shared, local = first["runs"]["shared"][0], first["runs"]["local"][0]
    for row in (shared, local, second["runs"]["shared"][0]):
        assert row["requests"] == 24 and sum(row["requests_per_replica"]) == 24
        assert row["moved_rounds"] == 16  # every later round moves
        assert row["ttft"]["moved"]["count"] == 16 and row["ttft"]["all"]["count"] == 24
        assert row["io_errors"] == 0 and row["fell_back"] == 0
        assert row["tokens_gpu"] + row["tokens_host"] + row["tokens_disk"] + row[
            "tokens_remote"] + row["tokens_computed"] == row["tokens_prompt"]
    assert local["tokens_remote"] == 0 and local["fetches"] == 0
    assert shared["tokens_remote"] > 0 and shared["fetch_failures"] == 0
    assert shared["published"] > 0
    assert shared["tokens_computed"] < local["tokens_computed"]
    assert set(first["goodput"]) == set(POPULATIONS)
    assert set(first["goodput"]["moved"]) == {"shared", "local"}
    assert doc["figures"]["prefill_rate_per_replica"]["value"] > 0
    for prefix in ("goodput", "goodput_window", "goodput_all"):
        for mode in ("shared", "local"):
            figure = doc["figures"][f"{prefix}_{mode}"]  # 30 s: one tiny run meets it
            assert figure["limit"] == pytest.approx(doc["capacity_requests_per_s"], rel=1e-3)
            assert figure["repeats"] == 2 and figure["min"] <= figure["value"] <= figure["max"]
    # One rate that both meet: a tie in every repeat, and no ratio the grid pins.
    vs = doc["summary"]["goodput"]["moved"]["shared_vs_local"]
    assert vs["tied"] == 2 and vs["ratio"]["median"] is None
    per_rate = doc["summary"]["per_rate"][0]["shared"]["moved"]["p99_s"]
    assert per_rate["n"] == 2 and per_rate["min"] <= per_rate["median"] <= per_rate["max"]
