"""The torch engine: the teacher as a transformers model in plain PyTorch, batched forward
passes (`engine`), media through the model's own processor (`media`), and the shared-prompt
cache its padded passes reuse (`prefix`)."""
