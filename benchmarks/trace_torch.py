"""Where a torch_bridge step's time goes: torch.profiler over a few steps, per shape and backward
strategy. For each: the step's time three ways (CUDA events synced per step; 10 steps back to back;
bench_gpu.bench_ms, as bench_gpu.py times it), the GPU kernel time per step, the kernels grouped by
name, the largest idle gaps between kernels, the slowest host calls, and with --host cProfile's
view of the host side.

    python benchmarks/trace_torch.py --shapes T1,T3,H200-pub --paths fwd,fast,lean
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import torch_bridge
from bench_gpu import bench_ms  # (this script's folder is on sys.path)
from rlk_common import SHAPES  # docs/design.md §6

STEPS = 3


def make_step(path, h, w, t, g):
    if path == "fwd":
        def step():
            with torch.no_grad():
                torch_bridge.linear_logp(h, w, t, mode="strict", validate_targets=False)
        return step

    def step():
        h.grad = w.grad = None
        torch.autograd.backward(torch_bridge.linear_logp(h, w, t, mode="strict", backward=path,
                                                         validate_targets=False), g)
    return step


def event_ms(step, reps=10, back_to_back=1):
    """Median CUDA-event ms per step over reps samples of back_to_back steps, synced between samples."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        for _ in range(back_to_back):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return sorted(times)[reps // 2]


def host_profile(step, calls=200):
    """The host side of a step: cProfile's top entries by own time (a C++ entry point's time counts
    in its Python caller's)."""
    import cProfile
    import pstats
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:14]
    print(f"host, us per step (own / cumulative), {calls} steps:")
    for (file, line, fn), (_, nc, tt, ct, _) in rows:
        print(f"  {tt / calls * 1e6:7.1f} {ct / calls * 1e6:7.1f}  {nc / calls:g}x {file.rsplit('/', 2)[-1]}:{line}({fn})")


def trace(step):
    """GPU kernels and memsets/memcpys of STEPS steps: [(start_us, end_us, name)], sorted by start."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    gpu, cpu = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu.append((e.time_range.start, e.time_range.end, e.name))
        elif e.name.startswith(("rlk::", "cuda", "aten::empty", "aten::to", "aten::copy_")):
            cpu.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(gpu), sorted(cpu)


def report(name, path, step, host):
    """One path's breakdown: a heading with its times, the kernels, the gaps, the host calls."""
    for _ in range(3):
        step()
    synced, b2b = event_ms(step), event_ms(step, 5, 10)
    bench = bench_ms(step)
    gpu, cpu = trace(step)
    busy = sum(e - s for s, e, _ in gpu) / 1e3 / STEPS
    print(f"\n## {name} {path}\n\nms per step: synced {synced:.3f}, 10 back to back {b2b:.3f}, do_bench {bench:.3f}; "
          f"GPU busy {busy:.3f}, {len(gpu) // STEPS} GPU ops\n")
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for s, e, n in gpu:
        by_name[n][0] += 1
        by_name[n][1] += (e - s) / 1e3
    print("| kernel | calls/step | ms/step |\n|---|---|---|")
    for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"| {n[:90]} | {c / STEPS:g} | {t / STEPS:.3f} |")
    gaps = sorted(((gpu[i + 1][0] - gpu[i][1], gpu[i][2], gpu[i + 1][2]) for i in range(len(gpu) - 1)),
                  reverse=True)[:6]
    print("\nlargest gaps between GPU ops (us, after -> before):")
    for gap, a, b in gaps:
        print(f"  {gap:9.1f}  {a[:50]} -> {b[:50]}")
    slow_cpu = sorted(((e - s, n) for s, e, n in cpu), reverse=True)[:6]
    print("slowest host calls (us): " + ", ".join(f"{n} {d:.0f}" for d, n in slow_cpu))
    if host:
        host_profile(step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="T1,T3,H200-pub")
    ap.add_argument("--paths", default="fwd,fast,lean")
    ap.add_argument("--host", action="store_true", help="also cProfile the host side of each step")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        n, hd, v = SHAPES[name]
        torch.manual_seed(0)
        h = torch.randn(n, hd, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(v, hd, device="cuda") * hd ** -0.5).bfloat16().requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda")
        g = torch.randn(n, device="cuda")
        for path in args.paths.split(","):
            report(name, path, make_step(path, h, w, t, g), args.host)
        del h, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
