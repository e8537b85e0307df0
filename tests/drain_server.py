"""A server process for the drain tests: a delayed real engine, serving until SIGTERM.

Arguments: the model directory, the delay per batch (seconds), and optionally the drain grace.
"""

from __future__ import annotations

import asyncio
import sys

from proctor.server.front.runtime import ProctorServer
from proctor.server.front.settings import ServerOptions

from support.routers import slow_router


async def main(model_dir: str, delay: float, grace: float) -> int:
    router, _ = slow_router(model_dir, delay)
    server = ProctorServer(router, ServerOptions(grpc_port=0, http_port=0, drain_grace_s=grace))
    print(f"proctor: gRPC on 127.0.0.1:{server.grpc_port}, HTTP on 127.0.0.1:{server.http_port}", flush=True)
    await server.serve_until_terminated()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 30.0)))
