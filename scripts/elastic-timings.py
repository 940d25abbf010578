#!/usr/bin/env python3
"""The timings docs/elastic.md gives for a node's drop and its rejoin, measured by the runs its tests make.

    .venv/bin/python scripts/elastic-timings.py --kills 20 --seed 1 --json docs/bench/elastic-timings.json

Runs odc-py/tests' own scenarios on 3 emulated nodes x 2 ranks (``LOCAL_WORLD_SIZE`` emulation; ``shm``, or
``mixed``: libfabric ``tcp`` between the nodes), each checked as its test checks it (every sum exact over the
members of its minibatch, the replicas bitwise equal, a joiner's state bitwise its source's): a run that fails
its check stops the script, so no timing of a wrong run is kept.

- **drop** (``test_elastic.py``): ``--kills`` runs of ``test_random_kill_points`` (a random rank SIGKILLed at a
  random point of a random minibatch, half over ``mixed``, every second one ``deterministic=True``), and a whole
  node killed at once on each transport (``test_a_whole_node_killed_at_once_is_dropped``): from the death to
  each survivor's return from the minibatch that dropped the node.
- **rejoin** (``test_rejoin.py``): rank 3 killed in minibatch 1 and its node restarted, on each transport
  (``test_a_restarted_node_rejoins_...``), and ``--kills`` runs of ``test_random_kills_and_rejoins``: the
  members' admit at the boundary that let the node in, their other boundaries, the joiner's ``rejoin`` call
  (asking, the members' step, registration and copy), and how many minibatches after its drop it was back.

The random cases are drawn as the tests draw them: the same ``--seed`` and count give the runs that
``ODC_ELASTIC_SEED`` / ``ODC_REJOIN_SEED`` and ``ODC_ELASTIC_KILLS`` / ``ODC_REJOIN_KILLS`` give. The JSON
(``--json``) carries the command, commit and load average (``odc.bench.report``); docs/elastic.md renders it
(``<!-- odc:bench elastic-drop ... -->``, ``elastic-rejoin``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "odc-py" / "tests"


def _drops(kills: int, seed: int) -> list[dict[str, Any]]:
    import test_elastic as E
    from _dist import run_ranks

    out = []
    rng = random.Random(seed)
    for i in range(kills):  # as test_random_kill_points draws them
        victim, at = rng.randrange(E.WORLD), rng.randrange(E.STEPS - 1)
        where, delay = rng.choice(["start", "pushed", "finish"]), rng.uniform(0.0, rng.choice([0.003, 0.05]))
        transport = rng.choice(["shm", "mixed"])
        case = {"victim": victim, "at": at, "where": where, "delay": round(delay, 4), "transport": transport,
                "deterministic": i % 2 == 1}
        res = run_ranks(E._elastic, E.WORLD, timeout=120, **case)
        try:
            recovery = E._check_run(res, victim, at)
        except AssertionError as e:
            raise SystemExit(f"elastic-timings: drop run {i}: {case}: the test's check failed: {e}") from None
        survivor = next(r for r in range(E.WORLD) if r // E.LOCAL != victim // E.LOCAL)
        dropped = res[survivor][1]["events"][0]["minibatch"]
        out.append({"series": "random", "case": case, "dropped": dropped, "death_to_step_s": recovery})
        _say(f"drop run {i}: {case}: dropped at {dropped}; death to the survivors' step "
             f"{min(recovery):.3f}-{max(recovery):.3f} s")
    for transport in ("shm", "mixed"):  # as test_a_whole_node_killed_at_once_is_dropped
        case = {"victim": 3, "at": 1, "where": "start", "delay": 0.0, "transport": transport, "whole_node": True}
        res = run_ranks(E._elastic, E.WORLD, timeout=120, **case)
        survivors = [r for r in range(E.WORLD) if r // E.LOCAL != 1]
        for r in survivors:
            status, got = res[r]
            if status != "ok" or [(e["minibatch"], e["node"]) for e in got["events"]] != [(1, 1)]:
                raise SystemExit(f"elastic-timings: whole node over {transport}: rank {r}: {str(res[r])[:2000]}")
            for k in range(E.STEPS):
                nodes = [0, 1, 2] if k < 1 else [0, 2]
                if got["sums"][k] != E._expected(k, nodes, r % E.LOCAL, len(got["sums"][0])):
                    raise SystemExit(f"elastic-timings: whole node over {transport}: rank {r}: wrong sum at {k}")
        recovery = [res[r][1]["death_to_step_s"][1] for r in survivors]
        out.append({"series": "whole node", "case": case, "dropped": 1, "death_to_step_s": recovery})
        _say(f"whole node over {transport}: death to the survivors' step {min(recovery):.3f}-{max(recovery):.3f} s")
    return out


def _rejoin_row(tests: Any, series: str, case: dict[str, Any], res: dict[int, Any]) -> dict[str, Any]:
    drop, back = tests._check_rejoin(res, case["victim"], case["at"])
    live = [r for r in range(tests.WORLD) if r // tests.LOCAL != case["victim"] // tests.LOCAL]
    admit = [res[r][1]["boundary_s"][back - 1] for r in live]
    other = [v for r in live for k, v in res[r][1]["boundary_s"].items() if k != back - 1]
    joiners = [res[tests.WORLD + i][1]["rejoin_s"] for i in range(tests.LOCAL)]
    return {"series": series, "case": case, "drop": drop, "back": back, "admit_s": admit,
            "other_boundary_max_s": max(other), "joiner_s": joiners}


def _rejoins(kills: int, seed: int) -> list[dict[str, Any]]:
    import test_rejoin as R
    from _dist import run_ranks

    out = []
    for transport in ("shm", "mixed"):  # as test_a_restarted_node_rejoins_with_a_replicas_state_...
        case = {"victim": 3, "at": 1, "transport": transport}
        try:
            out.append(_rejoin_row(R, "one kill", case, run_ranks(R._rejoin_run, R.WORLD + R.LOCAL, timeout=180,
                                                                   **case)))
        except AssertionError as e:
            raise SystemExit(f"elastic-timings: rejoin over {transport}: the test's check failed: {e}") from None
        _say(f"rejoin over {transport}: {out[-1]}")
    rng = random.Random(seed)
    for i in range(kills):  # as test_random_kills_and_rejoins draws them
        victim, at = rng.randrange(R.WORLD), rng.randrange(R.STEPS - 3)
        where, delay = rng.choice(["start", "pushed", "finish"]), rng.uniform(0.0, rng.choice([0.003, 0.05]))
        case = {"victim": victim, "at": at, "where": where, "delay": round(delay, 4),
                "transport": rng.choice(["shm", "mixed"])}
        try:
            out.append(_rejoin_row(R, "random", case, run_ranks(R._rejoin_run, R.WORLD + R.LOCAL, timeout=180,
                                                                **case)))
        except AssertionError as e:
            raise SystemExit(f"elastic-timings: rejoin run {i}: {case}: the test's check failed: {e}") from None
        row = out[-1]
        _say(f"rejoin run {i}: {case}: dropped at {row['drop']}, back at {row['back']}; the joiner waited "
             f"{max(row['joiner_s']):.3f} s; members' admit {max(row['admit_s']):.3f} s")
    return out


def _say(text: str) -> None:
    print(f"# {text}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20, help="random kill runs of each series (drop, rejoin)")
    ap.add_argument("--seed", type=int, default=1, help="the random series' seed (the tests' ODC_*_SEED)")
    ap.add_argument("--only", choices=["drop", "rejoin"], help="one series only")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    if args.kills < 0:
        ap.error(f"--kills {args.kills}: must be 0 or more")
    if args.json:
        from odc.bench.report import sample_load

        sample_load()  # the load average while the run lasts, for the JSON's provenance
    sys.path.insert(0, str(TESTS))
    start = time.monotonic()
    drop = _drops(args.kills, args.seed) if args.only != "rejoin" else []
    rejoin = _rejoins(args.kills, args.seed) if args.only != "drop" else []
    _say(f"{time.monotonic() - start:.0f} s")
    if args.json:
        from odc.bench.report import write_json

        write_json(args.json, {"bench": "elastic-timings", "args": vars(args), "world": 6, "per_node": 2,
                               "drop": drop, "rejoin": rejoin, "load_average": os.getloadavg(),
                               "cpus": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
