"""Megatron distributed checkpoints as teachers: `adapter` (megatron-core's and mbridge's names,
and the releases supported) and `convert` (a checkpoint turned once into the safetensors folder
an engine loads, cached by the checkpoint's own fingerprint)."""
