"""A server process for the drain test: a delayed real engine, serving until SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from proctor.server.runtime import ProctorServer, ServerOptions

from slow_engine import slow_router


async def main(model_dir: str, delay: float) -> int:
    router, _ = slow_router(model_dir, delay)
    server = ProctorServer(router, ServerOptions(grpc_port=0, http_port=0, drain_grace_s=30))
    print(f"proctor: gRPC on 127.0.0.1:{server.grpc_port}, HTTP on 127.0.0.1:{server.http_port}", flush=True)
    return await server.serve_forever()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], float(sys.argv[2]))))
