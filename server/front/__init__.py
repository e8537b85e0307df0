"""The front process: the transports, the one ScoringService they share, routing and supervision
of replicas, batching, and the answers. It runs no engine code: replicas live in workers
(`proctor.server.worker`).

- gRPC: `grpc_app`. HTTP, split as vLLM's entrypoints are: `http_app` (the app), `http_router`
  (thin routes), `http_models` and `openai_compat` (one request model per endpoint),
  `score_serving` and `completions_serving` (serving through the service), `http_request`,
  `http_errors`, `cancellation` (a call cancelled when its client disconnects, no polling),
  `teacher_tokenizers`, `completion_json`, `bounded_json`, `auth`.
- `service` (validation via `validation`, admission, deadlines) and `responses` (every answer).
- `routing` (Router, ReplicaSet), `replicas` (one replica's lifecycle), `supervisor` (restarts,
  strikes, probes), `batcher`, `batch_isolation`, `replica_faults`.
"""
