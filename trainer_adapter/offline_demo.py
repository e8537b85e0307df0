"""Training from a stored dataset: the demo's noisy student distils from top-k scores scored once by
`proctor score-dataset`, with no teacher running.

    python -m proctor.trainer_adapter.offline_demo DATA_DIR MODEL_DIR [--steps 20] [--out out]

Each step takes the next `batch` of the first `sequences` stored sequences
(`proctor.client.offline.OfflineScores`, epochs wrapping), runs the student over their token ids and trains it with `distillation_loss`'s
`forward_kl_topk` on the stored top-k, exactly as online; the loss curve is plotted
(`plot.plot_losses`). The student is the teacher with noise on its weights (`student.noisy_student`),
so the loss must fall: a flat curve means the stored rows or their alignment are wrong.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from proctor.client.loss import distillation_loss
from proctor.client.offline import OfflineScores, packed_scores
from proctor.trainer_adapter.plot import plot_losses
from proctor.trainer_adapter.student import noisy_student, response_hidden

UNIT = "nats per response token"


def train_offline(data_dir: Path | str, model_dir: Path | str, *, steps: int = 20, batch: int = 8, lr: float = 3e-3,
                  noise: float = 0.5, seed: int = 0, sequences: int | None = None) -> list[dict]:
    """Train the noisy student for `steps` steps on the stored dataset (its first `sequences`, epochs
    wrapping); one metrics dict per step."""
    dataset = OfflineScores(data_dir)
    count = min(len(dataset), sequences or len(dataset))
    student = noisy_student(model_dir, noise=noise, seed=seed)
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    config = {"loss_mode": "forward_kl_topk", "topk": dataset.identity.topk, "use_task_rewards": False,
              "log_prob_min_clamp": None, "loss_agg_mode": "token-mean"}
    weight = student.get_output_embeddings().weight
    logs = []
    for step in range(steps):
        items = [dataset[(step * batch + i) % count] for i in range(batch)]
        hidden, _ = response_hidden(student, [(s.token_ids.tolist(), s.prompt_length) for s in items])
        teacher = packed_scores(items)
        output = distillation_loss(config, student_hidden=hidden, student_weight=weight,
                                   teacher_topk_ids=teacher["teacher_topk_ids"],
                                   teacher_topk_logprobs=teacher["teacher_topk_logprobs"])
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        logs.append({"step": step + 1, **{k: output.metrics[k] for k in ("loss", "loss_min", "loss_max")}})
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(description="Distil the noisy student from a stored dataset's top-k.")
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("model_dir", type=Path, help="the teacher's directory (the student is it, with noise)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=16, help="train on the first N stored sequences (epochs)")
    parser.add_argument("--out", type=Path, default=Path("out"))
    args = parser.parse_args()
    logs = train_offline(args.data_dir, args.model_dir, steps=args.steps, batch=args.batch, sequences=args.sequences)
    args.out.mkdir(parents=True, exist_ok=True)
    plot = args.out / "loss_offline_forward_kl_topk.png"
    plot_losses(plot, [x["loss"] for x in logs], [x["loss_min"] for x in logs], [x["loss_max"] for x in logs],
                "offline distillation: forward_kl_topk from stored top-k", unit=UNIT)
    (args.out / "loss_offline_forward_kl_topk.json").write_text(json.dumps(logs, indent=1))
    print(f"loss {logs[0]['loss']:.4f} -> {logs[-1]['loss']:.4f} {UNIT} in {len(logs)} steps; plot {plot}")


if __name__ == "__main__":
    main()
