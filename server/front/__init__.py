"""The front process: the transports, the one ScoringService they share, and the answers. It runs
no engine code: replicas live in workers (`proctor.server.worker`).

- `grpc_app` (the gRPC shell) and `http` (the HTTP shell, a package of its own).
- `service` (validation via `validation`, with the id rule in `ids` and the media rules in
  `media_fields`; admission, deadlines), `aligned_request` and
  `aligned_scoring` (a student with another tokenizer), `responses`, `completion_json` and
  `generate_json` (every answer), `bounded_json` (JSON from untrusted peers), `auth`, `settings` (the server's options)
  and `runtime` (both transports in one event loop).
- `fleet`: the replicas behind a teacher (routing, lifecycle, supervision, batching, drift).
"""
