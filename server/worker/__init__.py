"""The replica worker: the process one replica's engine runs in (`main`), the front's handle on
it (`client`: `WorkerClient`), the messages between them (`messages`, framed by `protocol`), the
shared-memory arena large answers travel through (`arena`) and the answers' wire encoding
(`wire`). A worker placed by Ray is an actor (`ray_worker`) reached through `ray_engine`, on
placement groups `ray_actor` owns."""
