"""The replica fleet behind each teacher: `routing` (Router, ReplicaSet), `replicas` (one
replica's lifecycle), `supervisor` (restarts, strikes, probes), `batcher`, `batch_isolation`,
`replica_faults` and `drift` (replicas that agree, checked).

It knows engines only through `proctor.server.engines.base.TeacherEngine` and nothing of the
transports: the service hands it validated requests.
"""
