"""Test support shared by the suites (tests/) and the benchmarks (bench/), outside the server
package so that nothing here ships with proctor.

One job a module:

- `reference`: the reference teacher, a plain transformers forward in proctor's row convention;
- `engines`: the real torch engine behind delays, kill and freeze switches, or declaring media;
- `routers`: routers built from those engines (a busy teacher, two keyed teachers, injected replicas);
- `servers`: servers in this process or as `proctor serve` subprocesses, and what tests read from them;
- `scoring`: blocking gRPC scoring calls and the random sequences suites send;
- `configs`: config files (verl's `distillation:` block plus `server:`) written from dicts.

Tests import it as `support` (pytest puts tests/ on sys.path); benchmarks insert tests/ first.
"""
