"""Every ```python block of README.md runs as written, on the CPU, each in a fresh interpreter.

The convention (also stated at the top of the README): only fences whose info string is `python`
run. A block right after the HTML comment `<!-- not run: REASON -->` is skipped with REASON; one
right after `<!-- run: N processes -->` runs in N processes with the environment torchrun gives
them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as
`torchrun --nproc-per-node N block.py` would. Links of the README point at files in the repository.
"""
import dataclasses
import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT_S = 120
MARK = re.compile(r"^<!--\s*(not run:\s*(?P<reason>.+?)|run:\s*(?P<procs>\d+)\s+process(es)?)\s*-->$")


@dataclasses.dataclass
class Block:
    line: int          # 1-based line of the opening fence
    section: str       # the heading above it
    code: str
    skip: str | None   # the reason, for a `not run` block
    procs: int         # 1, or N for a `run: N processes` block

    @property
    def id(self):
        return f"L{self.line}-{re.sub(r'[^A-Za-z0-9]+', '_', self.section).strip('_')}"


def python_blocks(text: str) -> list[Block]:
    lines, blocks, section, i = text.splitlines(), [], "top", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        fence = re.match(r"^(`{3,})\s*(\S*)", line)
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), None)
        assert end is not None, f"README.md:{i + 1}: a code fence that is never closed"
        if fence.group(2) == "python":
            prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARK.match(prev)
            blocks.append(Block(line=i + 1, section=section, code="\n".join(lines[i + 1:end]) + "\n",
                                skip=m and m.group("reason"), procs=int(m.group("procs")) if m and m.group("procs") else 1))
        i = end + 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def cpu_env(**extra):
    """This process's environment on the CPU only, with the directories this process imports our
    packages from first on the path (pytest may have found them through its own sys.path)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", **extra)
    env.pop("XLA_FLAGS", None)  # conftest's 8 test devices are not what a user has
    dirs = []
    for name in ("rlk_xla", "torch_bridge", "rlk_common", "_rlk_core"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            origin = pathlib.Path(spec.origin)
            dirs.append(str(origin.parent.parent if origin.name == "__init__.py" else origin.parent))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(dirs + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_block(block: Block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    port = free_port()
    procs = []
    for rank in range(block.procs):
        env = cpu_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(block.procs), LOCAL_WORLD_SIZE=str(block.procs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)) if block.procs > 1 else cpu_env()
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    failures = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failures.append(f"process {rank}: no exit within {TIMEOUT_S} s\n{out[-3000:]}")
            continue
        if p.returncode:
            failures.append(f"process {rank}: exit {p.returncode}\n{out[-3000:]}")
    if failures:
        pytest.fail(f"README.md:{block.line} ({block.section}) failed:\n" + "\n".join(failures), pytrace=False)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 3, [b.id for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_python_block_runs(block, tmp_path):
    if block.skip:
        pytest.skip(f"README.md:{block.line} is marked not run: {block.skip}")
    if block.procs > 1 or "torch" in block.code:
        pytest.importorskip("torch", reason="torch is not installed: this example needs it")
    if re.search(r"^\s*(import|from) (jax|rlk_xla)\b", block.code, re.M):
        pytest.importorskip("jax", reason="jax is not installed: this example needs it")
    run_block(block, tmp_path)


def test_readme_links_point_inside_the_repository():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
    local = [t.split("#")[0] for t in links if not re.match(r"[a-z]+:|#", t)]
    bad = [t for t in local if not (ROOT / t).resolve().is_relative_to(ROOT) or not (ROOT / t).exists()]
    assert local and not bad, f"README links to paths outside the repository or missing: {bad}"
