"""Writes a Megatron distributed checkpoint of a Hugging Face folder, as a training run does:
megatron-core's GPTModel (built by mbridge's bridge from the folder's config.json, its weights
loaded by the bridge) saved by megatron-core's own `dist_checkpointing` (torch_dist), in
Megatron-LM's layout (`model`, `iteration`, `checkpoint_version`).

Run once per rank (`RANK`, `WORLD_SIZE`, `PORT` in the environment; world size = TP size):
    python tests/support/megatron_writer.py HF_DIR CKPT_DIR STEP

On CPU: the model uses megatron-core's local (non-Transformer-Engine) layer spec, whose sharded
keys are those of the Transformer Engine spec a GPU run saves (megatron-core maps them), so the
checkpoint reads as a GPU run's would. megatron-core 0.16.1's saver calls `torch.cuda.synchronize`
and `torch.cuda.current_device` (for a status tensor) unconditionally; on CPU-only torch they are
replaced, in this process only, by their CPU meaning (nothing to wait for; the CPU device).
"""

from __future__ import annotations

import os
import sys

import torch

# megatron-core's local spec keeps the two layer norms apart; its sharded keys (and mbridge's
# names) are the Transformer Engine spec's fused ones: the map megatron-core itself applies.
_LOCAL_TO_TE = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _local_spec_bridge(hf_dir: str):
    from mbridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    if not hasattr(config, "rope_theta"):  # transformers 5 keeps it in rope_parameters; mbridge reads it here
        config.rope_theta = config.rope_parameters["rope_theta"]
    base = type(AutoBridge.from_config(config))

    def te_name(name: str) -> str:
        for local, te in _LOCAL_TO_TE.items():
            name = name.replace(local, te)
        return name

    class LocalSpecBridge(base):
        def _get_transformer_layer_spec(self, vp_stage=None):
            return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)

        def _weight_name_mapping_mcore_to_hf(self, name):
            return super()._weight_name_mapping_mcore_to_hf(te_name(name))

        def _weight_to_mcore_format(self, name, weights):
            return super()._weight_to_mcore_format(te_name(name), weights)

    bridge = LocalSpecBridge(config, dtype=torch.float32)
    bridge.config.use_cpu_initialization = True
    bridge.config.perform_initialization = False
    bridge.config.sequence_parallel = False  # torch's norms do not support it (no Apex / TE here)
    return bridge


def main(hf_dir: str, ckpt_dir: str, step: int) -> None:
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=world)
    bridge = _local_spec_bridge(hf_dir)
    model = bridge._model_provider([])(pre_process=True, post_process=True)
    bridge.load_weights([model], hf_dir)
    os.makedirs(ckpt_dir, exist_ok=True)
    # The saver's own results queue (its manager process) is kept: a fork queue put in its place was
    # faster to start but raced (an empty queue read before the writers' results arrived).
    state = {"model": model.sharded_state_dict(), "iteration": step, "checkpoint_version": 3.0}
    dist_checkpointing.save(state, ckpt_dir)
    dist.destroy_process_group()


if __name__ == "__main__":  # the saver's worker processes re-import this file
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
