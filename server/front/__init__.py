"""The front process: the transports (`grpc_app`, `http_app`, `openai_compat`), the one
ScoringService they share (`service`: validation, admission, deadlines), routing to replicas
(`routing`), a replica's lifecycle and its supervision (`replicas`, `supervisor`), batching (`batcher`, `batch_isolation`, `replica_faults`)
and the answers (`responses`). It runs no engine code: replicas live in workers
(`proctor.server.worker`)."""
