"""The replica worker: the process one replica's engine runs in (`main`), the front's handle on
it (`client`: `WorkerClient`; `ray_actor` for a worker placed by Ray), the messages between
them (`protocol`), the shared-memory arena large answers travel through (`arena`) and the
answers' wire encoding (`wire`)."""
