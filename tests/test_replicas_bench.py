"""bench.replicas: the router's placement rule, its flags, and one tiny comparison on a real
cluster (two replica processes, with and without the shared tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.replicas import build_parser, main, route, run_benchmark
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


TINY = ["--model", "tiny", "--layers", "2", "--vocab", "512", "--dtype", "float32",
        "--users", "8", "--rounds", "3", "--system-tokens", "32", "--history-tokens", "64",
        "--question-tokens", "16", "--answer-tokens", "4", "--block-size", "16",
        # One request's worth of GPU: admitting the next request evicts (and so publishes)
        # the previous one's blocks before its user's next round reaches the other replica.
        "--gpu-blocks", "11", "--host-blocks", "64", "--disk-blocks", "256",
        "--move-probability", "1", "--rates", "0.05", "--no-cost-aware",
        "--skip-fetch-probe", "--progress", "never", "--slo-ttft-p99", "30"]


def test_a_moved_user_is_served_from_the_shared_tier_and_recomputes_without_it(
    redis_cluster: LocalRedisCluster, tmp_path: Path,
) -> None:
    argv = [*TINY, "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "disk")]
    path = run_benchmark(build_parser().parse_args(argv), argv, redis_cluster)
    doc = json.loads(path.read_text())
    assert doc["bench"] == "replicas" and doc["machine"] == "cpu" and doc["commit"]
    assert path.name.startswith("replicas-cpu-")
    shared, local = doc["runs"]["shared"][0], doc["runs"]["local"][0]
    for row in (shared, local):
        assert row["requests"] == 24 and sum(row["requests_per_replica"]) == 24
        assert row["moved_rounds"] == 16  # every later round moves
        assert row["io_errors"] == 0 and row["fell_back"] == 0
        assert row["tokens_gpu"] + row["tokens_host"] + row["tokens_disk"] + row[
            "tokens_remote"] + row["tokens_computed"] == row["tokens_prompt"]
    assert local["tokens_remote"] == 0 and local["fetches"] == 0
    assert shared["tokens_remote"] > 0 and shared["fetch_failures"] == 0
    assert shared["published"] > 0
    assert shared["tokens_computed"] < local["tokens_computed"]
    assert set(doc["goodput"]) == {"shared", "local"}
    assert doc["figures"]["prefill_rate_per_replica"]["value"] > 0
    for mode in ("shared", "local"):
        figure = doc["figures"][f"goodput_{mode}"]  # 30 s: one tiny run meets it
        assert figure["limit"] == pytest.approx(doc["capacity_requests_per_s"], rel=1e-3)
