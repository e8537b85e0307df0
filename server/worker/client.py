"""A replica's engine in a worker process of its own, seen by the front as an ordinary engine.

Why a process: the front process serves every replica of a server, so nothing per token may
run there (a vLLM replica's output processing, the torch engine's forward pass and its Python
would share the front's interpreter with the transports); the worker (`worker.main`) runs the
engine and answers results already in wire form. And a vLLM replica spawns its EngineCore
(and, with TP > 1, its workers), which inherit the environment of the process that spawns
them: several replicas of one server need several `CUDA_VISIBLE_DEVICES` /
`ASCEND_RT_VISIBLE_DEVICES` values at once, which one `os.environ` cannot hold, so each
worker starts with its environment given explicitly. The replicas start concurrently, nothing
blocks the event loop, and killing a replica means killing its worker's whole process group
(EngineCore included, also when it is stopped or wedged).

Faults are the host's or its engine's: the host exiting (killed, crashed) fails every call in
flight with `EngineError` at once; an engine that raises on a batch, its process alive, fails
that call with `BatchFailed` (the batcher then isolates the request at fault); a host or engine that stops answering fails its health
check after `health_timeout_s`; a start that does not finish within the spec's
`startup_timeout_s` is killed and fails with the last lines of its output.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch

from proctor.server.engines.base import (
    DEFAULT_TOKEN_BUDGET,
    BatchFailed,
    EngineError,
    EngineInfo,
    EngineRequest,
    EngineSpec,
    Outcome,
    TeacherEngine,
    started_info,
)
from proctor.server.engines.invariance import invariance_environment
from proctor.server.engines.vllm.args import cpu_binding_environment
from proctor.server.worker import messages
from proctor.server.worker.arena import create_arena
from proctor.server.worker.pool import VISIBLE_DEVICES_ENV
from proctor.server.worker.protocol import Channel

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 60
CLOSE_GRACE_S = 10.0


def engine_environment(spec: EngineSpec) -> dict[str, str]:
    """The variables a replica's engine processes must start with: its visible devices (on CPU, a
    vLLM replica's own cores: `cpu_binding_environment`), and the switch of vLLM's batch-invariant
    mode for a batch-invariant vLLM teacher (`invariance`)."""
    kind = spec.device.split(":", 1)[0]
    var = VISIBLE_DEVICES_ENV.get(kind)
    devices = list(spec.devices)
    if not devices and ":" in spec.device:
        devices = [spec.device.split(":", 1)[1]]
    visible = {var: ",".join(devices)} if var is not None and devices else {}
    cores = sorted(os.sched_getaffinity(0))
    return {**visible, **invariance_environment(spec), **cpu_binding_environment(spec, cores, os.environ)}


def host_spec(spec: EngineSpec) -> EngineSpec:
    """The spec the host builds its engine from: its devices are all it sees, numbered from 0."""
    from dataclasses import replace

    kind, _, _ = spec.device.partition(":")
    return replace(spec, device=kind) if kind in VISIBLE_DEVICES_ENV else spec


class WorkerClient(TeacherEngine):
    """`worker.main` as a child process, spoken to over a socket pair.

    `build` makes the worker's engine from the spec there (default `create_engine`); it travels
    pickled, so it must be importable in the worker (`env` may extend its PYTHONPATH)."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        name: str = "",
        health_timeout_s: float | None = None,
        build: Callable[[EngineSpec], TeacherEngine] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.spec = spec
        self.name = name or spec.name
        self.build = build
        self.extra_env = dict(env or {})
        self.health_timeout_s = float(health_timeout_s or (spec.inference or {}).get("health_timeout_s") or 15.0)
        self._proc: asyncio.subprocess.Process | None = None
        self._channel: Channel | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._ready: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._info: EngineInfo | None = None
        self._budget = DEFAULT_TOKEN_BUDGET
        self._unembedding: torch.Tensor | None = None
        self._exit: str | None = None
        self._suspect = False  # a health check or call failed: close kills at once, no goodbye

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The replica worker's pid (its process group holds the engine's own processes)."""
        return self._proc.pid if self._proc is not None else None

    def log_tail(self) -> str:
        return "".join(self._tail)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        arena = create_arena()  # the worker's large reply buffers come through it (`worker.arena`)
        fds = (theirs.fileno(),) if arena is None else (theirs.fileno(), arena)
        env = {**os.environ, **engine_environment(self.spec), **self.extra_env, "PYTHONUNBUFFERED": "1"}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proctor.server.worker.main", *map(str, fds),
                pass_fds=fds, env=env, start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
        except BaseException:
            if arena is not None:
                os.close(arena)
            raise
        finally:
            theirs.close()
        self._channel = await Channel.open(ours)
        if arena is not None:
            self._channel.read_arena(arena)
        self._ready = loop.create_future()
        self._tasks = [
            loop.create_task(self._read_replies(), name=f"proctor-host-{self.name}-replies"),
            loop.create_task(self._pump_output(), name=f"proctor-host-{self.name}-output"),
            loop.create_task(self._watch_exit(), name=f"proctor-host-{self.name}-exit"),
        ]
        self._send(messages.Start(host_spec(self.spec), self.build))
        timeout = self.spec.startup_timeout_s
        try:
            self._info, self._budget = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            await self.close()
            raise EngineError(
                f"{self.name}: the {self.spec.name} engine did not start within {timeout:.0f} s "
                f"(inference.startup_timeout_s); its last output:\n{self.log_tail()}"
            ) from None
        except BaseException:
            await self.close()
            raise
        log.info("%s: %s engine ready in replica worker %d", self.name, self.spec.name, self.pid)

    async def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None and self._channel is not None and not self._suspect:
            with contextlib.suppress(Exception):
                self._send(messages.Close())
                await asyncio.wait_for(proc.wait(), CLOSE_GRACE_S)
        self._kill_group()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), CLOSE_GRACE_S)
        for task in self._tasks:
            task.cancel()
        self._fail_all(EngineError(f"{self.name}: engine host closed"))
        if self._channel is not None:
            self._channel.close()
        self._proc, self._channel = None, None

    def _kill_group(self) -> None:
        """SIGKILL the host and everything it started (EngineCore, workers), stopped ones too."""
        proc = self._proc
        if proc is None:
            return
        victims = []
        with contextlib.suppress(Exception):
            import psutil

            victims = psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for child in victims:  # descendants that left the group (setsid) are killed by pid
            with contextlib.suppress(Exception):
                child.kill()

    # -- the socket ------------------------------------------------------------------------
    def _send(self, message: messages.Message) -> None:
        if self._channel is None or self._exit is not None:
            raise EngineError(f"{self.name}: engine host is not running ({self._exit or 'closed'})")
        self._channel.send(message)

    async def _call(self, ask: Callable[[int], messages.Message], timeout: float | None = None) -> Any:
        """Send `ask(call)` and wait for that call's answer."""
        call = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call] = future
        try:
            self._send(ask(call))
            return await (asyncio.wait_for(future, timeout) if timeout else future)
        finally:
            self._calls.pop(call, None)

    async def _read_replies(self) -> None:
        assert self._channel is not None
        while (message := await self._channel.receive()) is not None:
            self._on_message(message)
            message = None  # a reply's buffers (shared memory) are not held while the next is awaited

    def _on_message(self, message: messages.Message) -> None:
        """The one place the front acts on a worker message, by its kind."""
        match message:
            case messages.Ready(info, token_budget):
                if not self._ready.done():
                    self._ready.set_result((info, token_budget))
            case messages.StartFailed(text):
                if not self._ready.done():
                    self._ready.set_exception(EngineError(
                        f"{self.name}: engine failed to start: {text}; its last output:\n{self.log_tail()}"))
            case messages.Reply(call, value):
                self._answer(call, lambda future: future.set_result(value))
            case messages.Raised(call, cause, out_of_memory):  # the engine raised on this call, its process alive
                self._answer(call, lambda future: future.set_exception(
                    BatchFailed(f"{self.name}: {cause}", out_of_memory=out_of_memory)))
            case messages.Failed(call, text):
                self._answer(call, lambda future: future.set_exception(EngineError(f"{self.name}: {text}")))
            case _:
                log.error("%s: message %s is not one a worker sends", self.name, type(message).__name__)

    def _answer(self, call: int, settle: Callable[[asyncio.Future], None]) -> None:
        future = self._calls.get(call)
        if future is not None and not future.done():
            settle(future)

    async def _pump_output(self) -> None:
        """Keep the host's last lines (for errors) and pass them on to this process's stderr."""
        assert self._proc is not None and self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            text = line.decode(errors="replace")
            self._tail.append(text)
            sys.stderr.write(f"[{self.name}] {text}")

    async def _watch_exit(self) -> None:
        assert self._proc is not None
        code = await self._proc.wait()
        self._exit = f"replica worker exited with code {code}"
        error = EngineError(f"{self.name}: engine {self._exit}; its last output:\n{self.log_tail()}")
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
        self._fail_all(error)

    def _fail_all(self, error: EngineError) -> None:
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)

    # -- protocol --------------------------------------------------------------------------
    def describe(self) -> EngineInfo:
        return started_info(self._info, f"{self.name}: engine")

    def token_budget(self) -> int:
        return self._budget

    async def score(self, batch: list[EngineRequest]) -> list[Outcome]:
        try:
            return await self._call(lambda call: messages.Score(call, batch))
        except EngineError:
            self._suspect = True
            raise

    async def abort(self, request_keys: list[str]) -> None:
        with contextlib.suppress(EngineError):
            self._send(messages.Abort(list(request_keys)))

    async def check_health(self) -> bool:
        if self._exit is not None or self._proc is None:
            return False
        try:
            healthy = bool(await self._call(messages.Health, timeout=self.health_timeout_s))
        except (TimeoutError, EngineError):
            healthy = False
        self._suspect = self._suspect or not healthy
        return healthy

    def unembedding(self) -> torch.Tensor:
        """The weights live in the worker: `fetch_unembedding` asks it; this is what it got."""
        if self._unembedding is None:
            raise EngineError(f"{self.name}: the unembedding was not fetched from the worker yet")
        return self._unembedding

    async def fetch_unembedding(self) -> torch.Tensor:
        """From the worker's engine (the torch model's own output embedding; vLLM's from its
        checkpoint), once; cut to the vocabulary the teacher serves."""
        if self._unembedding is None:
            weight = await self._call(messages.Unembedding)
            if self._info is not None:
                weight = weight[: self._info.vocab_size].contiguous()
            self._unembedding = weight
        return self._unembedding
