"""The README and the documentation site (docs/, mkdocs.yml): the README stays a page a
newcomer reads in minutes, its links resolve, its example runs as written, and the site
builds with mkdocs in strict mode (a broken link or a docstring the API reference cannot
render fails the build)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_is_short():
    lines = README.count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move the detail to a page under docs/"


def test_readme_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    assert targets, "no links found: the pattern no longer matches the README's links"
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_docs_page_is_in_the_site_navigation():
    import yaml
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == listed, f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}; " \
                            f"nav entries without a page: {sorted(listed - pages)}"


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' "
                                          "(the test extra has it, so CI runs this)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    # The API reference is generated from the docstrings, not written by hand.
    for name in ("ZeroAdam", "clip_grad_norm_", "consolidated_state_dict", "init_states"):
        assert name in reference, f"the generated API reference lacks {name}"
    assert "every rank writes what it owns" in reference.lower()  # a module docstring


def test_the_readme_example_trains_on_two_ranks(tmp_path):
    block = README.split("## Example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "torchrun --nproc_per_node=2 train.py" in block
    (tmp_path / "train.py").write_text(block)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_"))}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=2", "train.py"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # (The final loss alone would not do: with lr=0 it is 1.11, under any fixed bar near it.)
    first, last = map(float, re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out.stdout).groups())
    assert last < 0.9 * first, f"the example did not train: loss {first} -> {last}"
    assert (tmp_path / "ckpt" / "manifest.json").exists()
