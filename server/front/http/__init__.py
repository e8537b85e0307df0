"""The HTTP shell, split as vLLM's entrypoints are: `app` (the app), `router` (thin routes),
`models`, `openai_compat` and `sglang_compat` with `sglang_fields` (one request model per
endpoint), `score_serving`, `completions_serving` and `sglang_serving` (serving through the service), `request` (what every call reads the same
way), `errors`, `cancellation` (a call cancelled when its client disconnects, no polling),
`limits` (uvicorn's protocol bounds, the metrics port) and `teacher_tokenizers`.

Nothing below the front imports it: it is a shell over `proctor.server.front.service`.
"""
