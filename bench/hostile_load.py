"""A normal client under each attack of issue 34, side by side with no attack.

`proctor serve` (the torch engine on the tiny teacher, a bearer token, the tiny student's
tokenizer for aligned requests) runs in its own process. For each attack of
`tests/support/hostile.py` (and once with none) attacker processes send it in a loop while a
normal client, in this process, sends its four calls in turn (plain and aligned, gRPC and HTTP)
and a probe polls `/health/live`. Printed per attack: the normal calls made, how many failed, their
p50 and p99 latency and the p99's ratio to the no-attack run (side by side: the same machine, the
same minute), and the slowest `/health/live`. Failures and refusals are counts that do not depend
on the machine's load; the latencies are wall clock, so read the ratios.

    python bench/hostile_load.py [--seconds 8] [--attackers 2] [--attacks NAME,...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.hostile import ATTACKS, attackers, normal_client
from support.servers import SubprocessServer

TOKEN = "bench-token"


def _serve(workdir: Path) -> SubprocessServer:
    from proctor.server.cli.tiny_model import (
        STUDENT_SEED,
        STUDENT_VOCAB_SIZE,
        ensure_default_model,
        make_tiny_model,
    )

    student = make_tiny_model(workdir / "student", vocab_size=STUDENT_VOCAB_SIZE, seed=STUDENT_SEED,
                              student_tokenizer=True)
    token_file = workdir / "token"
    token_file.write_text(TOKEN)
    return SubprocessServer(["--model", str(ensure_default_model()), "--teacher-name", "tiny",
                             "--student-tokenizer", f"student={student}", "--auth-token-file", str(token_file)])


def _run(server: SubprocessServer, names: list[str], *, seconds: float, processes: int) -> dict:
    """The normal client's calls (latency, failure) and the probe's latencies, under `names`."""
    stop, probes = threading.Event(), []

    def probe() -> None:
        with httpx.Client(base_url=server.http_url, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    ok = client.get("/health/live").status_code == 200
                except httpx.HTTPError:
                    ok = False
                probes.append(time.perf_counter() - started if ok else float("inf"))
                time.sleep(0.02)

    pool = results = None
    if names:
        pool, results = attackers(server, TOKEN, names, processes=processes, seconds=seconds + 6)
        time.sleep(5)  # spawned interpreters start
    prober = threading.Thread(target=probe)
    prober.start()
    latencies, failures = normal_client(server, TOKEN, seconds)
    stop.set()
    prober.join()
    sent = 0
    if pool is not None:
        try:
            sent = sum(result.get(timeout=120) for result in results)
        except Exception as exc:  # an attack answered otherwise than refused: a finding, print it
            print(f"  attack {names}: {exc!r}"[:300])
        pool.terminate()
        pool.join()
    return {"calls": len(latencies), "failures": failures, "p50": float(np.percentile(latencies, 50)),
            "p99": float(np.percentile(latencies, 99)), "live_max": max(probes), "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = _serve(Path(tmp))
        try:
            rows = {"no attack": _run(server, [], seconds=args.seconds, processes=0)}
            for name in args.attacks.split(","):
                rows[name] = _run(server, [name], seconds=args.seconds, processes=args.attackers)
        finally:
            server.stop()
    base = rows["no attack"]["p99"]
    print(f"{'attack':<34}{'attacks':>9}{'calls':>7}{'failed':>8}{'p50 ms':>9}{'p99 ms':>9}{'p99 x':>7}"
          f"{'live max ms':>13}")
    for name, row in rows.items():
        print(f"{name:<34}{row['sent']:>9}{row['calls']:>7}{len(row['failures']):>8}{row['p50'] * 1e3:>9.1f}"
              f"{row['p99'] * 1e3:>9.1f}{row['p99'] / base:>7.2f}{row['live_max'] * 1e3:>13.1f}")
    for name, row in rows.items():
        for failure in row["failures"][:3]:
            print(f"  {name}: {failure}")


if __name__ == "__main__":
    main()
