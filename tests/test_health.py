"""Health: NOT_SERVING / 503 while the teacher loads, SERVING / 200 once every teacher has a replica."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proctor.server.engines.base import EngineSpec
from proctor.server.engines.factory import create_engine
from proctor.server.front.fleet.routing import Replica, ReplicaSet, Router
from proctor.server.front.runtime import ServerThread
from proctor.server.front.settings import ServerOptions

from support.engines import InjectedEngine


class SlowLoadingEngine(InjectedEngine):
    async def start(self) -> None:
        await asyncio.sleep(1.5)
        await super().start()


def test_health_says_not_serving_while_loading_then_serving(tiny_model_dir):
    async def build():
        return SlowLoadingEngine(create_engine(EngineSpec(name="torch", model_path=str(tiny_model_dir))))

    server = ServerThread(Router([ReplicaSet("tiny", [Replica("tiny-0", build)])]), ServerOptions(grpc_port=0, http_port=0))
    server.start(wait=False)
    try:
        channel = grpc.insecure_channel(server.grpc_target)
        health = health_pb2_grpc.HealthStub(channel)
        grpc.channel_ready_future(channel).result(timeout=10)
        for service in ("", "proctor.v1.TeacherScoring"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert httpx.get(server.http_url + "/health/live").status_code == 200
        assert httpx.get(server.http_url + "/health/ready").status_code == 503
        reply = httpx.post(server.http_url + "/v1/score", json={"token_ids": [1, 2]})
        assert reply.status_code == 503 and "retry-after" in reply.headers
        server.loading.result(timeout=60)
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(server.http_url + "/health/ready").status_code == 200
    finally:
        server.stop()
