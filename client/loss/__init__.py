"""Distillation losses for on-policy distillation (trainer side; torch only).

Every loss returns a float32 per-token tensor ``[N]``, differentiable in the
student inputs; masking and reduction are separate (``aggregate``). The
vocabulary-wide losses run on one chunking core (``chunking``) so that neither
the student's nor the teacher's ``[N, V]`` logits are ever materialised when
both sides are given as hidden states and unembeddings, and on one base
(``chunked_loss``): each states its formula per token chunk, the base owns the
chunk loop, the autograd plumbing and the gradients of the per-token and
reduced forms alike.

Families: ``sampled_kl`` (single-sample estimators), ``topk_kl`` (teacher's
top-k), ``student_topk_reverse_kl`` (the reverse KL on the student's top-k), ``full_vocab_kl`` (exact, from teacher hidden states),
``cross_tokenizer`` (a teacher of another tokenizer: chunk likelihoods, GOLD-style hybrid), plus the
verl-compatible ``distillation_loss`` entry point. The vocabulary-wide losses
have reduced forms (``full_vocab_kl_reduced``, ``topk_kl_reduced``) that take the
aggregation's per-token weights (``aggregate_weights``) up front and form the
gradients in the forward pass, at the matmul floor; ``MatmulWork`` counts that
work.
"""

from proctor.proto.loss_modes import HIDDEN_STATE_MODES, LOSS_MODES, TOPK_MODES

from .aggregate import AGG_MODES, aggregate, aggregate_weights
from .chunking import Chunking
from .cross_tokenizer import chunk_likelihood_loss, gold_hybrid_loss
from .distillation import DistillationOutput, distillation_loss
from .full_vocab import full_vocab_kl, full_vocab_kl_reduced
from .metrics import loss_metrics
from .reduced import Reduced
from .sampled import SAMPLED_MODES, sampled_kl
from .settings import LossSettings
from .student_topk import student_topk_masses, student_topk_reverse_kl
from .topk import topk_kl, topk_kl_reduced, topk_masses
from .work import MatmulWork, matmul_flops

__all__ = [
    "AGG_MODES",
    "HIDDEN_STATE_MODES",
    "LOSS_MODES",
    "SAMPLED_MODES",
    "TOPK_MODES",
    "Chunking",
    "DistillationOutput",
    "LossSettings",
    "MatmulWork",
    "Reduced",
    "aggregate",
    "aggregate_weights",
    "chunk_likelihood_loss",
    "distillation_loss",
    "full_vocab_kl",
    "full_vocab_kl_reduced",
    "gold_hybrid_loss",
    "loss_metrics",
    "matmul_flops",
    "sampled_kl",
    "student_topk_masses",
    "student_topk_reverse_kl",
    "topk_kl",
    "topk_kl_reduced",
    "topk_masses",
]
