"""Score -> loss -> backward: one distillation step's losses against a running proctor server.

Run `.venv/bin/proctor serve` (the built-in tiny teacher), then
`.venv/bin/python examples/score_loss_backward.py [grpc://127.0.0.1:50051]`.
The README's "Losses" section prints this file; tests/test_readme_snippets.py runs both.
"""

import sys

import torch

from proctor.client import SyncTeacherClient
from proctor.client.loss import aggregate, full_vocab_kl, sampled_kl, topk_kl

target = sys.argv[1] if len(sys.argv) > 1 else "grpc://127.0.0.1:50051"
prompt, response = [12, 40, 7, 99], [5, 17, 250, 31, 8]  # one rollout, in the teacher's vocabulary

with SyncTeacherClient(target) as client:
    scores = client.score(prompt + response, prompt_length=len(prompt), topk=16, hidden_states=True)
    teacher_weight = client.unembedding()  # the teacher's lm_head [V, H], for the full-vocabulary losses

# The student's logits for the response tokens [R, V] (rows prompt_length..T-1: row i predicts
# token i). A stand-in here; in training, your student's forward pass over the same ids.
torch.manual_seed(0)
student_logits = torch.randn(len(response), teacher_weight.shape[0], requires_grad=True)
student_logprobs = torch.log_softmax(student_logits, -1).gather(1, torch.tensor(response)[:, None]).squeeze(1)

per_token = {
    "k3": sampled_kl(student_logprobs, scores.logprobs, "k3"),  # the sampled token only
    "forward_kl_topk": topk_kl(scores.topk_ids.long(), scores.topk_logprobs, student_logits=student_logits),
    "full_forward_kl": full_vocab_kl(scores.hidden_states.float(), teacher_weight.float(),
                                     student_logits=student_logits),  # exact, over the whole vocabulary
}
mask = torch.ones(len(response), dtype=torch.bool)  # which response tokens are trained on
for name, loss in per_token.items():
    value = aggregate(loss, mask, "token-mean")
    student_logits.grad = None
    value.backward()
    print(f"{name}: {value.item():.4f} nats/token, |grad| {student_logits.grad.norm():.4f}")
