"""The fault proxy's plans on their own (no server): what a test of recovery may count on."""

from __future__ import annotations

from sbatch_gen.testing.faultproxy import cycle_plan


def _run(plan, requests):
    return [plan(m, p, n) for n, (m, p) in enumerate(requests)]


def test_cycle_plan_hits_every_nth_request_in_turn_with_503_bursts():
    plan = cycle_plan(every=2, burst=2)
    got = _run(plan, [("GET", f"/b/k{i}") for i in range(10)])
    assert got == [None, "503", "503", "reset", None, "truncate", None, "slow", None, "503"]


def test_cycle_plan_lets_a_request_through_after_max_in_a_row_failures():
    # a retry that lands on a fault slot every time (a 503 on every request): it fails at most 3 times
    # in a row, then passes, whatever the other clients do in between
    plan = cycle_plan(every=1, faults=("503",), burst=1, max_in_a_row=3)
    retries = [plan("PUT", "/b/r1/us.done", n) for n in range(8)]
    assert retries == ["503", "503", "503", None, "503", "503", "503", None]
    # other keys keep their own count
    plan = cycle_plan(every=1, faults=("503",), burst=1, max_in_a_row=2)
    got = _run(plan, [("PUT", "/b/x"), ("GET", "/b/y"), ("PUT", "/b/x"), ("PUT", "/b/x"), ("GET", "/b/y")])
    assert got == ["503", "503", "503", None, "503"]


def test_slow_and_listings_do_not_count_as_failures():
    plan = cycle_plan(every=1, faults=("slow", "truncate"), burst=1, max_in_a_row=1)
    # truncate never hits a listing (it passes instead), slow only delays: neither starts a streak
    assert _run(plan, [("GET", "/b/?list-type=2")] * 4) == ["slow", None, "slow", None]
