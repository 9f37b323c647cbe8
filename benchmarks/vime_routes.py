"""The logp stage of vime's loss, per route of torch_bridge.vime.provider, against vime's native path:
time (forward + backward) and peak extra memory, from the output layer's input hidden [T, H] and its
weight [V, H] (one TP rank) to the gradients of hidden and weight.

    python3 benchmarks/vime_routes.py --device cpu --shape 512,256,32000
    python3 benchmarks/vime_routes.py --device cuda --shape T3          # 6827 x 2048 x 75968

Routes, as vime runs them (with_entropy, entropy without gradient; temperature 0.7):
- native:      Megatron's output layer (logits fp32 [T, V]) then vime's native log_softmax / gather;
- reuse:       the same logits through the provider's logits route (context.reuse_local_logits);
- recompute:   the same logits (vime's request always carries them) and the provider's context route
               (the fused kernels from hidden and weight; the logits checked on sampled rows, unused);
- hidden_only: the vime-side change of docs/vime.md (Megatron returns hidden states,
               torch_bridge.integrations.megatron.hidden_states_only): no logits at all, the fused kernels.
Each route runs in its own process (CPU peak memory is the process's high-water mark, ru_maxrss,
above the RSS before the first stage; CUDA: torch.cuda.max_memory_allocated above the allocation
before it), the inputs and the weight excluded.
Time: the median of --reps runs after one warm-up. Prints a markdown table; --out writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # vime_side: vime's native path and request, for the tests too

ROUTES = ("native", "reuse", "recompute", "hidden_only")
SHAPES = {"T3": (6827, 2048, 75968)}  # T x H x V per rank (docs/benchmarks.md's T3 at TP = 2)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stage(route, h, w, targets, g):
    """One forward + backward of the logp stage; returns logp."""
    import torch
    import vime_side
    from torch_bridge import vime
    hidden = h.detach().requires_grad_()
    weight = w.detach().requires_grad_()
    temp = 0.7
    if route == "hidden_only":
        logits, meta = None, {}
    else:
        logits = torch.nn.functional.linear(hidden, weight).float() / temp  # Megatron's output layer, vime's scaling
        meta = {"logits_are_temperature_scaled": True}
    req = vime_side.request(targets, logits=logits, hidden=hidden, weight=weight, temperature=temp,
                            with_entropy=True, with_entropy_grad=False, metadata=meta,
                            reuse_local_logits=route == "reuse")
    if route == "native":
        logp, _ = vime_side.native(req)
    else:
        res = vime.provider(req, "auto")
        assert res.provenance["route"] == ("logits" if route == "reuse" else "fused"), res.provenance
        logp = res.logp
    torch.autograd.backward((logp[:, 0] * g).sum(), inputs=[hidden, weight])
    return logp


def child(args):
    import torch
    dev = torch.device(args.device)
    torch.manual_seed(0)
    t, hdim, v = args.shape
    h = torch.randn(t, hdim, device=dev).to(torch.bfloat16)
    w = (torch.randn(v, hdim, device=dev) * 4 / hdim ** 0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (t,), device=dev)
    g = torch.randn(t, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:  # large buffers are mmapped: freed ones leave the RSS, the high-water mark stays
        base = _rss()
    _stage(args.route, h, w, targets, g)  # warm-up (its peak counts: the same stage)
    times = []
    for _ in range(args.reps):
        sync()
        t0 = time.perf_counter()
        _stage(args.route, h, w, targets, g)
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    times.sort()
    print(json.dumps({"route": args.route, "ms": 1e3 * times[len(times) // 2], "ms_min": 1e3 * times[0],
                      "ms_max": 1e3 * times[-1], "peak_extra_mb": (peak - base) / 2 ** 20}))


def _shape(s):
    return SHAPES[s] if s in SHAPES else tuple(int(x) for x in s.split(","))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", type=_shape, default=(512, 256, 32000), help="T,H,V per rank, or T3")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--out")
    p.add_argument("--route", help=argparse.SUPPRESS)  # the child process's route
    args = p.parse_args()
    if args.route:
        return child(args)
    routes = args.routes.split(",")
    try:
        from tqdm import tqdm
        bar = tqdm(routes, file=sys.stderr)
    except ImportError:
        bar = routes
    rows = []
    for route in bar:
        cmd = [sys.executable, __file__, "--device", args.device, "--shape", ",".join(map(str, args.shape)),
               "--reps", str(args.reps), "--route", route]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    t, hdim, v = args.shape
    native = next((r for r in rows if r["route"] == "native"), None)
    print(f"logp stage (forward + backward), {args.device}, T x H x V = {t} x {hdim} x {v}, bf16 inputs, "
          f"median of {args.reps}\n")
    print("| route | ms (min-max) | x native | peak extra MB |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = f"{native['ms'] / r['ms']:.2f}x" if native else "-"
        print(f"| {r['route']} | {r['ms']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f}) | {ratio} | "
              f"{r['peak_extra_mb']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": args.device, "shape": [t, hdim, v], "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
