"""Real servers for tests and benchmarks: in this process on loopback, or `proctor serve` in a
process of its own, and what a test reads back from them (metrics, engines, readiness).

Every port is picked by the operating system (port 0) unless a test needs to know it first.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from proctor.server.front.fleet.routing import Router
from proctor.server.front.runtime import ServerThread
from proctor.server.front.settings import ServerOptions

T = TypeVar("T")

def start_server(router: Router, **options) -> ServerThread:
    """`router` served in this process on free loopback ports; `options` are ServerOptions fields."""
    options.setdefault("grpc_port", 0)
    options.setdefault("http_port", 0)
    return ServerThread(router, ServerOptions(**options)).start()


def start_worker_server(spec, teacher: str, build: Callable) -> ServerThread:
    """One teacher of one replica whose worker process builds its engine with `build` (a function
    of tests/support, importable in the worker: tests/ is put on its PYTHONPATH)."""
    from proctor.server.front.fleet.routing import ReplicaSet, engine_replica
    from proctor.server.worker.client import WorkerClient

    name = f"{teacher}-0"
    path = [str(Path(__file__).resolve().parents[1]), *[p for p in sys.path if p]]
    replica = engine_replica(name, lambda: WorkerClient(spec, name=name, build=build, env={"PYTHONPATH": ":".join(path)}))
    return start_server(Router([ReplicaSet(teacher, [replica])]))


def free_port() -> int:
    """A port free now, for a test that must know a server's port before starting it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_value(server: ServerThread, name: str) -> float:
    """One sample of the server's metrics, summed over its label sets (0 when absent)."""
    text = server.server.service.metrics.render().decode()
    return sum(float(found) for found in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE))


def request_count(server: ServerThread, outcome: str) -> float:
    """proctor:requests_total summed over teachers and modes for one outcome."""
    text = server.server.service.metrics.render().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("proctor:requests_total{") and f'outcome="{outcome}"' in line:
            total += float(re.split(r"\s+", line)[-1])
    return total


def engine_of(server: ServerThread, teacher: str):
    """The engine of `teacher`'s first replica, for counters the wire does not show."""
    return server.server.service.router.teachers[teacher].replicas[0].engine


def poll_live_while(url: str, call: Callable[[], T], *, interval: float = 0.01) -> tuple[list[float], float, T]:
    """Poll `url`'s `/health/live` from a thread while `call()` runs here: each poll's latency
    (every poll must be answered 200), the call's seconds, and what it returned."""
    import httpx

    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=30) as client:
            while not done.is_set():
                started = time.perf_counter()
                assert client.get("/health/live").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(interval)

    with ThreadPoolExecutor(1) as pool:
        probing = pool.submit(probe)
        time.sleep(0.1)
        started = time.perf_counter()
        try:
            value = call()
        finally:
            took = time.perf_counter() - started
            done.set()
        probing.result()
    return latencies, took, value


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> None:
    """Poll until `predicate()` holds; fail the test if it does not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


@dataclass
class ServerUnderTest:
    """What the engine-agnostic service tests need to know about a running server."""

    engine: str
    grpc_target: str
    http_url: str
    model_dir: Path
    atol: float


class SubprocessServer:
    """`proctor serve` in its own process (engines such as vLLM want their own main process).

    Startup reads the server's first line for its ports, then waits for `/health/ready`; the
    output keeps being collected in `log` (replica processes log their pids there).
    """

    def __init__(self, args: list[str], *, startup_timeout: float = 240, command: list[str] | None = None) -> None:
        """`command` replaces `proctor serve ... args` (a script that serves a router of its own
        and prints the same first line)."""
        import httpx

        self.proc = subprocess.Popen(
            command or [sys.executable, "-m", "proctor.server.cli.main", "serve", "--grpc-port", "0", "--http-port", "0",
                        *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.log: list[str] = []
        deadline = time.monotonic() + startup_timeout
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited during startup:\n" + "".join(self.log[-40:]))
            self.log.append(line)
            match = re.search(r"gRPC on (\S+):(\d+), HTTP on (\S+):(\d+)", line)
            if match:
                self.grpc_target = f"{match.group(1)}:{match.group(2)}"
                self.http_url = f"http://{match.group(3)}:{match.group(4)}"
                break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
        threading.Thread(target=self._drain_output, daemon=True).start()
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.http_url + "/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("server exited during startup:\n" + "".join(self.log[-40:]))
            time.sleep(0.5)
        raise TimeoutError("server never became ready:\n" + "".join(self.log[-40:]))

    def _drain_output(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (the server drains), then SIGKILL if it has not exited within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except Exception:
            self.proc.kill()
            return self.proc.wait()


def replica_names(server: SubprocessServer, engine: str | None = None) -> dict[int, str]:
    """Replica worker pid -> its replica's id, from the "<replica>: <engine> engine ready in replica
    worker <pid>" lines an engine host logs (of any engine when `engine` is None)."""
    kind = r"\S+" if engine is None else re.escape(engine)
    return {int(m.group(2)): m.group(1) for line in list(server.log)
            if (m := re.search(rf"(\S+): {kind} engine ready in replica worker (\d+)", line))}


def engine_processes(server: SubprocessServer, engine: str = "vllm", marker: str = "EngineCore") -> dict:
    """replica id -> the engine process of that replica of a `proctor serve` process.

    Each vLLM-family replica runs in an engine host (`proctor.server.worker.main`) that logs
    "<replica>: <engine> engine ready in replica worker <pid>"; its engine process (vLLM's
    EngineCore, vLLM-Omni's StageEngineCoreProc: `marker` in its name or command line) is a
    child of the replica worker.
    """
    import psutil

    hosts = replica_names(server, engine)
    cores = {}
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if proc.pid not in hosts:
            continue
        for child in proc.children(recursive=True):
            try:  # a dying replica leaves zombies and vanishing processes in the tree
                if marker in child.name() or marker in " ".join(child.cmdline()):
                    cores[hosts[proc.pid]] = child
            except psutil.Error:
                continue
    return cores


def engine_cores(server: SubprocessServer) -> dict:
    """replica id -> the vLLM EngineCore process of that replica of a `proctor serve` process."""
    return engine_processes(server)


def replica_metrics(server) -> dict[tuple[str, str], float]:
    """(sample name, replica) -> value for the replica counters and gauges of a server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(server.http_url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if "replica" in sample.labels:
                out[(sample.name, sample.labels["replica"])] = sample.value
    return out


def metric_total(metrics: dict, name: str) -> float:
    """One sample summed over the replicas (`replica_metrics`)."""
    return sum(v for (n, _), v in metrics.items() if n == name)


def alive(proc) -> bool:
    """A psutil.Process that runs (not gone, not a zombie)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class KilledUnderLoad:
    """What `kill_one_under_load` saw: requests in flight at the kill, each call's error (None:
    answered) and every answer by request id (a request answered twice is listed twice)."""

    killed_with: int
    errors: list
    answered: dict[str, list]


def kill_one_under_load(stub, work: dict[str, list[int]], victim, survivor, *, in_flight_at_kill: int,
                        wait_s: float, call_timeout: float) -> KilledUnderLoad:
    """Score `work` (request id -> ids, log-probs) from one thread each while both engine processes
    are held stopped (SIGSTOP), so the requests surely wait in the server; once at least
    `in_flight_at_kill` are in flight (waiting up to `wait_s`), SIGKILL `victim`, resume `survivor`
    and collect every call. The survivor is resumed whatever happens."""
    import os

    from proctor.proto import scoring_pb2

    answered: dict[str, list] = {}
    in_flight = [0]
    lock = threading.Lock()

    def call(item):
        request_id, ids = item
        with lock:
            in_flight[0] += 1
        try:
            response = stub.Score(scoring_pb2.ScoreRequest(request_id=request_id, token_ids=ids, logprobs=True),
                                  timeout=call_timeout)
        finally:
            with lock:
                in_flight[0] -= 1
        with lock:
            answered.setdefault(response.request_id, []).append(response)

    os.kill(victim.pid, signal.SIGSTOP)
    os.kill(survivor.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(work)) as pool:
            futures = [pool.submit(call, item) for item in work.items()]
            wait_for(lambda: in_flight[0] >= in_flight_at_kill, timeout=wait_s, interval=0.005)
            killed_with = in_flight[0]
            os.kill(victim.pid, signal.SIGKILL)
            os.kill(survivor.pid, signal.SIGCONT)
            errors = [f.exception() for f in futures]
    finally:
        if alive(survivor):
            os.kill(survivor.pid, signal.SIGCONT)
    return KilledUnderLoad(killed_with, errors, answered)


def tiny_bench_server(model, *, engine: str, topk: int, name: str, length: int) -> SubprocessServer:
    """`proctor serve` on a benchmark's tiny teacher: the torch engine, or vLLM (float32, eager, a
    tenth of the memory); its length fits sequences of `length` tokens and one more."""
    engine_args = (["--engine", "vllm", "--dtype", "float32", "--inference", "gpu_memory_utilization=0.1",
                    "--inference", "enforce_eager=true"] if engine == "vllm" else [])
    return SubprocessServer(["--model", str(model), "--max-topk", str(topk), "--teacher-name", name,
                             "--max-model-len", str(max(2048, length + 1)), "--no-verbose", *engine_args],
                            startup_timeout=600)
