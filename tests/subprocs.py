"""Running Python in fresh processes from a test, on the CPU: the README's examples, and JAX or
torch programs that span several processes (each with its own environment, one coordinator port)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_worker(rank: int, world: int, port, backend: str = "gloo"):
    """The process group of one rank of a multi-process test, for a worker whose results are written
    inside the block. On success the ranks meet, the group is torn down and the process leaves at
    once (os._exit(0)), skipping Python's finalization: torch's gloo run-loop threads can drop the
    last reference to a finished collective's tensors while the interpreter finalizes, and their
    GIL acquire then unwinds through a noexcept destructor: std::terminate, SIGABRT after the
    results were written (torch 2.13; about 1 run in 15 on 2 cores). An exception tears the group
    down and propagates."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield dist.group.WORLD
        dist.barrier()  # no rank closes its sockets while a peer still reads from them
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_env(**extra) -> dict:
    """This process's environment on the CPU only, with the directories this process imports our
    packages from first on the path (pytest may have found them through its own sys.path)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", **extra)
    env.pop("XLA_FLAGS", None)  # conftest's 8 test devices are not what a fresh process has
    dirs = []
    for name in ("rlk_xla", "torch_bridge", "rlk_common", "_rlk_core"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            origin = pathlib.Path(spec.origin)
            dirs.append(str(origin.parent.parent if origin.name == "__init__.py" else origin.parent))
    dirs.append(str(pathlib.Path(__file__).resolve().parent))  # tests/: the shared helpers, for scripts run by path
    paths = dirs + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def run_all(argvs: list[list[str]], envs: list[dict], cwd, timeout_s: float, grace_s: float = 15.0) -> list[str]:
    """Start one process per argv (python is prepended) at once and wait for all; returns a message
    (exit status or timeout, and the tail of its output) for each process that failed. Processes
    still running at the timeout, or grace_s after another one failed (its peers would wait on it
    for ever), are killed."""
    logs = [tempfile.TemporaryFile("w+") for _ in argvs]
    procs = [subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              text=True) for argv, env, log in zip(argvs, envs, logs)]
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode for p in procs):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    failures = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        killed = p.poll() is None
        if killed:
            p.kill()
        p.wait()
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        if killed:
            failures.append(f"process {i}: still running, killed (timeout {timeout_s} s, or a peer failed)\n{tail}")
        elif p.returncode:
            failures.append(f"process {i}: exit status {p.returncode}\n{tail}")
    return failures
