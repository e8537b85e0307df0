"""What every layer of the server uses and that depends on no other part of it: the contract's error
model (`errors`), background tasks (`background`), work moved off the event loop (`off_loop`),
Prometheus metrics (`metrics`) and the allocator tuning of the processes that move answers
(`malloc_tuning`)."""
