"""Every ```python block of README.md runs as written, on the CPU, each in a fresh interpreter.

The convention (also stated at the top of the README): only fences whose info string is `python`
run. A block right after the HTML comment `<!-- not run: REASON -->` is skipped with REASON; one
right after `<!-- run: N processes -->` runs in N processes with the environment torchrun gives
them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as
`torchrun --nproc-per-node N block.py` would. Each runs in an empty temporary directory. Links of the README point at files in the repository.
"""
import dataclasses
import pathlib
import re

import pytest

from subprocs import cpu_env, free_port, run_all

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TIMEOUT_S = 300  # a loaded 2-core machine: importing torch and the first call take most of it
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


def run_block(block: Block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block.code)
    if block.procs == 1:
        envs = [cpu_env()]
    else:
        port, world = str(free_port()), str(block.procs)
        envs = [cpu_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(block.procs)]
    failures = run_all([[str(script)]] * block.procs, envs, tmp_path, TIMEOUT_S)
    if failures:
        pytest.fail(f"README.md:{block.line} ({block.section}) failed:\n" + "\n".join(failures), pytrace=False)


def test_markers_select_and_skip_blocks():
    text = ("# A\n```python\nx = 1\n```\n```bash\nls\n```\n<!-- not run: needs a GPU -->\n\n```python\ny\n```\n"
            "## B\n<!-- run: 2 processes -->\n````python\nz = 1\n```\n````\n")
    a, b, c = python_blocks(text)
    assert (a.line, a.section, a.code, a.skip, a.procs) == (2, "A", "x = 1\n", None, 1)
    assert (b.skip, b.procs, b.code) == ("needs a GPU", 1, "y\n")
    assert (c.section, c.procs, c.code) == ("B", 2, "z = 1\n```\n")


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


def test_the_front_page_speaks_plainly():
    """The project's internal words (its machines, its shape nicknames) live in docs/benchmarks.md."""
    text = README.read_text()
    internal = ("device machine", "development machine", "H200-pub", "device_run.sh")
    assert not [w for w in internal if w in text], [w for w in internal if w in text]


def test_the_install_section_names_the_extras_and_the_matrix():
    text = README.read_text()
    section = text[text.index("### Install from a wheel"):text.index("### Into your own environment")]
    for word in ("[jax,torch]", "`[jax]`", "`[torch]`", "manylinux_2_34", "sm_80", "sm_90a", "cp312-abi3", "Size:"):
        assert word in section, word
