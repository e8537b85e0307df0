"""The server's runtime settings: one typed object, and the one table of their defaults.

`ServerOptions` is what `ProctorServer`, the gRPC server and the HTTP app are built from,
whole (none of them copies settings into arguments of its own). A config file's `server:`
block (`proctor.server.config.schema.ServerBlock`) takes its defaults from here and becomes
one `ServerOptions` in `config.builder.server_options`; `proctor serve`'s flags likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proctor.server.front.service import Limits

# Paths of the HTTP port that need no bearer token: probes and scrapers (`/health` is vLLM's
# readiness probe, which clients written for `vllm serve` call without a token, as vLLM allows).
OPEN_PATHS = ("/health", "/health/live", "/health/ready", "/metrics")


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    grpc_port: int = 50051
    http_port: int = 8000
    auth_token: str | None = None
    # Largest request or unary answer, both transports (gRPC's default limit is 4 MiB).
    max_message_bytes: int = 64 << 20
    stream_chunk_bytes: int = 2 << 20
    drain_grace_s: float = 30.0
    limits: Limits = field(default_factory=Limits)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: clients must present a certificate it signed
    open_paths: tuple[str, ...] = OPEN_PATHS
    # A second, plain-HTTP port serving only /metrics (for scrapers kept off the API port).
    metrics_port: int | None = None
    # HTTP connections (`front.http.limits`): a request's headers must begin within this many
    # seconds of the connection opening or of its previous answer; connections past the cap are closed.
    http_header_timeout_s: float = 10.0
    http_max_connections: int = 4096
    # Student tokenizers aligned requests may name: key -> tokenizer directory, loaded at start.
    student_tokenizers: dict[str, str] = field(default_factory=dict)
    # Where a teacher moved to a Megatron checkpoint (`checkpoint_move`) caches its conversion.
    checkpoint_cache_dir: str | None = None


DEFAULTS = ServerOptions()
