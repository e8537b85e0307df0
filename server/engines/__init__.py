"""The teacher engines: what scores a batch of sequences on a replica's devices.

`base` is the contract every engine keeps (requests, results, the two error kinds) and
`factory` picks one by `inference.name`; the shared pieces (`checkpoint`, `checks`,
`logit_transforms`, `row_scores`, `score_ids`, `multimodal`) serve every family. One folder per
family: `torch/` (plain PyTorch + transformers), `vllm/` (one vLLM pooling engine with proctor's
scoring model), `vllm_omni/` (vLLM-Omni's AR stage). An engine runs in a replica worker
(`proctor.server.worker`), never knowing the transports.
"""
