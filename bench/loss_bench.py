"""Full-vocabulary KL: dense vs teacher-chunked vs fully fused (per-token and reduced), forward + backward.

One run prints one table. Each variant runs in a fresh subprocess, so its peak
extra memory is honest: on CPU the RSS high-water mark (``ru_maxrss``) after the
run minus the one taken once the inputs exist; on CUDA the allocator's peak
minus the allocation after the inputs exist. Ratios are to (a), the dense torch
reference; "x floor" is the time over the matmul floor, 4 × 2·N·H·V flops
(student and teacher logits forward, the two student gradient matmuls
backward) at the rate ``torch.mm`` reaches for an ``[N, H] @ [H, V]`` product on
the same machine in the same run. "mm work" is the matrix-product work of one
forward + backward in units of 2·N·H·V, counted at the dispatcher (``MatmulWork``)
on a small shape: the machine-independent figure (the reduced loss forms its
gradients in the forward pass: 4, the floor; the per-token loss recomputes tiles
in its backward: 6, or 8 for the JSD). Liger-Kernel and cut-cross-entropy rows run
where they install (CUDA); cut-cross-entropy is a student-only cross-entropy on
hard labels, a timing reference for a fused linear loss rather than the same loss.

    python bench/loss_bench.py                    # N=4096 H=1024 V=32768 on CPU
    python bench/loss_bench.py --device cuda --n 16384 --v 151936
    python bench/loss_bench.py --quick            # small smoke run
    python bench/loss_bench.py --device cuda --direction jsd
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = {
    "dense": "(a) dense torch reference",
    "teacher_chunked": "(b) teacher chunked, student dense",
    "fused": "(c) fully fused, per-token",
    "reduced": "(d) fully fused, reduced (grads in fwd)",
    "liger": "(e) Liger-Kernel LigerFusedLinearJSD",
    "liger_chunked": "(f) Liger-Kernel LigerFusedLinearJSDLoss",
    "cce": "(g) cut-cross-entropy (student CE only)",
}
# Variants that exist only as CUDA (Triton) kernels in third-party packages.
EXTERNAL = {"liger": "liger_kernel", "liger_chunked": "liger_kernel", "cce": "cut_cross_entropy"}
COUNT_SHAPE = (256, 64, 2048)  # N, H, V of the matmul-work count


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="tokens")
    p.add_argument("--h", type=int, default=1024, help="hidden size (student and teacher)")
    p.add_argument("--v", type=int, default=32768, help="vocabulary size")
    p.add_argument("--device", default="cpu", help="cpu | cuda | npu")
    p.add_argument("--direction", default="forward", choices=["forward", "reverse", "jsd"])
    p.add_argument("--repeat", type=int, default=2, help="timed runs per variant (the best is kept)")
    p.add_argument("--chunk-tokens", type=int, default=None)
    p.add_argument("--chunk-vocab", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="small smoke run (N=256 H=64 V=1024, 1 repeat)")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.h, args.v, args.repeat = 256, 64, 1024, 1
    return args


# --------------------------------------------------------------------------- child side


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("npu"):
        torch.npu.synchronize()


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _device_mem(device: str) -> tuple[int, int]:
    """(current, peak) allocated bytes on an accelerator."""
    import torch

    mod = torch.cuda if device.startswith("cuda") else torch.npu
    return mod.memory_allocated(), mod.max_memory_allocated()


def _make_step(variant: str, args: argparse.Namespace, sh, sw, th, tw):
    """A closure running one forward + backward of ``variant``; returns the loss sum."""
    import torch

    kw = dict(direction=args.direction, chunk_tokens=args.chunk_tokens, chunk_vocab=args.chunk_vocab)
    from proctor.client.loss import full_vocab_kl, full_vocab_kl_reduced

    beta = {"forward": 0.0, "reverse": 1.0, "jsd": 0.5}[args.direction]
    if variant == "dense":

        def step():
            log_p = torch.log_softmax(sh @ sw.T, dim=-1)
            with torch.no_grad():
                log_q = torch.log_softmax(th @ tw.T, dim=-1)
            if args.direction == "forward":
                loss = (log_q.exp() * (log_q - log_p)).sum(-1)
            elif args.direction == "reverse":
                loss = (log_p.exp() * (log_p - log_q)).sum(-1)
            else:
                log_m = torch.logaddexp(log_p + torch.log(torch.tensor(0.5)), log_q + torch.log(torch.tensor(0.5)))
                loss = 0.5 * (log_q.exp() * (log_q - log_m)).sum(-1) + 0.5 * (log_p.exp() * (log_p - log_m)).sum(-1)
            total = loss.sum()
            total.backward()
            return total.item()

    elif variant == "teacher_chunked":

        def step():
            logits = sh @ sw.T
            total = full_vocab_kl(th, tw, student_logits=logits, **kw).sum()
            total.backward()
            return total.item()

    elif variant == "fused":

        def step():
            total = full_vocab_kl(th, tw, student_hidden=sh, student_weight=sw, **kw).sum()
            total.backward()
            return total.item()

    elif variant == "reduced":
        weights = torch.ones(sh.shape[0], device=sh.device)

        def step():
            total = full_vocab_kl_reduced(th, tw, weights, student_hidden=sh, student_weight=sw, **kw).total
            total.backward()
            return total.item()

    elif variant == "liger_chunked":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        try:
            jsd = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta)
        except TypeError:  # releases without the hard/soft split
            jsd = LigerFusedLinearJSDLoss(beta=beta)
        labels = torch.zeros(sh.shape[0], dtype=torch.long, device=sh.device)

        def step():
            out = jsd(sh, sw, th, tw, labels)
            total = (out[0] if isinstance(out, tuple) else out) * sh.shape[0]  # a token mean
            total.backward()
            return total.item()

    elif variant == "cce":
        from cut_cross_entropy import linear_cross_entropy

        labels = torch.randint(0, sw.shape[0], (sh.shape[0],), device=sh.device)

        def step():
            total = linear_cross_entropy(sh, sw, labels, reduction="sum")
            total.backward()
            return total.item()

    elif variant == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=beta)

        def step():
            # Liger reduces to a token mean; scale back to a sum for comparability.
            total = jsd(sh, sw, th, tw) * sh.shape[0]
            total.backward()
            return total.item()

    else:
        raise SystemExit(f"unknown variant {variant}")
    return step


def _child(args: argparse.Namespace) -> None:
    import torch

    if args.variant == "matmul":
        _child_matmul(args)
        return
    if args.variant in EXTERNAL:
        if not args.device.startswith("cuda"):
            print(json.dumps({"unavailable": "a CUDA (Triton) kernel; run with --device cuda"}))
            return
        try:
            __import__(EXTERNAL[args.variant])
        except Exception as exc:  # report why, never fail the table
            print(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}))
            return
    g = torch.Generator(device="cpu").manual_seed(0)
    dev = args.device
    scale = 2.0 / args.h**0.5
    # Scaled in place: a temporary copy would raise the RSS high-water mark before the baseline
    # is taken, and later allocations would then hide in that slack.
    sh = torch.randn(args.n, args.h, generator=g).to(dev).requires_grad_()
    sw = torch.randn(args.v, args.h, generator=g).mul_(scale).to(dev).requires_grad_()
    th = torch.randn(args.n, args.h, generator=g).to(dev)
    tw = torch.randn(args.v, args.h, generator=g).mul_(scale).to(dev)
    _sync(dev)
    on_cpu = dev == "cpu"
    if on_cpu:
        base = _rss_bytes()
    else:
        getattr(torch, dev.split(":")[0]).reset_peak_memory_stats()
        base = _device_mem(dev)[0]
    step = _make_step(args.variant, args, sh, sw, th, tw)
    times, total = [], 0.0
    for _ in range(max(1, args.repeat)):
        sh.grad = sw.grad = None
        _sync(dev)
        t0 = time.perf_counter()
        total = step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    peak = (_rss_bytes() if on_cpu else _device_mem(dev)[1]) - base
    print(json.dumps({
        "time_s": min(times),
        "peak_extra_bytes": peak,
        "loss_sum": total,
        "grad_h_norm": float(sh.grad.norm()),
        "grad_w_norm": float(sw.grad.norm()),
    }))


def _child_matmul(args: argparse.Namespace) -> None:
    """The rate ``torch.mm`` reaches on ``[N, H] @ [H, V]`` here, in flop/s."""
    import torch

    dev = args.device
    a = torch.randn(args.n, args.h, device=dev)
    b = torch.randn(args.h, args.v, device=dev)
    out = torch.empty(args.n, args.v, device=dev)
    torch.mm(a, b, out=out)
    _sync(dev)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"flops_per_s": 2.0 * args.n * args.h * args.v / best}))


def matmul_work(variant: str, args: argparse.Namespace) -> float:
    """Forward + backward matrix-product work of ``variant`` in units of 2·N·H·V, on CPU at COUNT_SHAPE."""
    import torch

    from proctor.client.loss import matmul_flops

    n, h, v = COUNT_SHAPE
    small = argparse.Namespace(**{**vars(args), "chunk_tokens": None, "chunk_vocab": None})
    g = torch.Generator().manual_seed(0)
    sh = torch.randn(n, h, generator=g).requires_grad_()
    sw = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).requires_grad_()
    th = torch.randn(n, h, generator=g)
    tw = torch.randn(v, h, generator=g) * (2.0 / h**0.5)
    # Tiles smaller than the shape, so that the per-token paths take several vocabulary chunks.
    if variant in ("teacher_chunked", "fused"):
        small.chunk_tokens, small.chunk_vocab = 64, 512
    step = _make_step(variant, small, sh, sw, th, tw)
    return matmul_flops(step) / (2.0 * n * h * v)


# --------------------------------------------------------------------------- parent side


def _run_child(variant: str, argv: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--variant", variant]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"unavailable": f"failed (exit {proc.returncode}): {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.variant is not None:
        _child(args)
        return
    import torch

    child_argv = [
        "--n", str(args.n), "--h", str(args.h), "--v", str(args.v), "--device", args.device,
        "--direction", args.direction, "--repeat", str(args.repeat),
    ]
    if args.chunk_tokens:
        child_argv += ["--chunk-tokens", str(args.chunk_tokens)]
    if args.chunk_vocab:
        child_argv += ["--chunk-vocab", str(args.chunk_vocab)]
    rate = _run_child("matmul", child_argv)["flops_per_s"]
    floor_s = 4 * 2.0 * args.n * args.h * args.v / rate
    print(
        f"full-vocab {args.direction} KL, forward+backward: N={args.n} H={args.h} V={args.v} "
        f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()}"
    )
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s -> floor (4 x 2NHV) {floor_s:.3f} s; "
          f"dense [N, V] float32 = {args.n * args.v * 4 / 2**20:.0f} MiB; "
          f"load average at start {os.getloadavg()[0]:.2f}")
    grads = (args.n + args.v) * args.h * 4  # grad_hidden + grad_weight: returned by every variant
    print(f"every variant must return the student gradients ([N, H] + [V, H] float32 = {grads / 2**20:.0f} MiB); "
          "'work' is the peak beyond them")
    header = (f"{'variant':<40} {'time s':>8} {'x dense':>8} {'x floor':>8} {'peak MiB':>9} {'x dense':>8} "
              f"{'work MiB':>9} {'x dense':>8} {'mm work':>8}  check")
    print(header)
    print("-" * len(header))
    results = {}
    for key, label in VARIANTS.items():
        r = _run_child(key, child_argv)
        results[key] = r
        if "unavailable" in r:
            print(f"{label:<40} unavailable: {r['unavailable']}")
            continue
        work_mm = f"{matmul_work(key, args):>8.2f}" if key not in EXTERNAL else f"{'n/a':>8}"
        dense = results.get("dense", {})
        t_ratio = r["time_s"] / dense["time_s"] if "time_s" in dense else float("nan")
        m_ratio = r["peak_extra_bytes"] / dense["peak_extra_bytes"] if "peak_extra_bytes" in dense else float("nan")
        work = max(0, r["peak_extra_bytes"] - grads)
        w_ratio = work / max(1, dense["peak_extra_bytes"] - grads) if "peak_extra_bytes" in dense else float("nan")
        check = ""
        if key == "cce":
            check = "a different loss (hard-label CE): timing reference only"
        elif "loss_sum" in dense and key != "dense":
            rel = abs(r["loss_sum"] - dense["loss_sum"]) / max(abs(dense["loss_sum"]), 1e-30)
            rel_g = abs(r["grad_w_norm"] - dense["grad_w_norm"]) / max(dense["grad_w_norm"], 1e-30)
            check = f"loss rel {rel:.1e}, |gW| rel {rel_g:.1e}"
        print(
            f"{label:<40} {r['time_s']:>8.3f} {t_ratio:>8.2f} {r['time_s'] / floor_s:>8.2f} "
            f"{r['peak_extra_bytes'] / 2**20:>9.1f} {m_ratio:>8.3f} {work / 2**20:>9.1f} {w_ratio:>8.3f} {work_mm}  {check}"
        )
    print(f"load average at end {os.getloadavg()[0]:.2f} (other work on the machine inflates wall times)")
    print(f"mm work: matrix-product flops of one forward + backward / (2 N H V), counted at N, H, V = {COUNT_SHAPE}")
    print("note: (c) takes an arbitrary grad_output [N], so its backward recomputes every tile (6 matmuls, 8 for "
          "the JSD); (d) takes the aggregation's weights up front and forms the gradients in the forward pass (4)")


if __name__ == "__main__":
    main()
