"""The docs run as written: every ```python and ```bash fence in README.md and docs/*.md carries a marker on the line
before it, and each one marked to run does, in order, in one scratch copy of the repository per page.

Markers (an HTML comment, invisible on GitHub):
    <!-- runs: 20s -->                     runs in CI; 20s is what it needs (the test allows 5x, at least a minute)
    <!-- example: needs a GPU -->          shown, not run; the reason is required

Python fences run with this interpreter, shell fences with bash and this interpreter's bin/ first on PATH (the
activated venv the docs assume). A runnable fence that reads ../shared/data skips where that folder is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
MARKER = re.compile(r"<!--\s*(runs|example):\s*(.*?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Snippet:
    """One fenced block: where it is, its language, its marker (kind, value) and its code."""

    page: Path
    line: int
    language: str
    marker: tuple[str, str] | None
    code: str

    @property
    def seconds(self) -> int:
        """The time a `runs:` marker states."""
        return int(re.fullmatch(r"(\d+)s", self.marker[1]).group(1))


def snippets(page: Path) -> list[Snippet]:
    """Every python/shell fence of a Markdown page with the marker on the line before it (None if absent)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) in LANGUAGES:
            before = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            marker = (before.group(1), before.group(2)) if before else None
            out.append(Snippet(page, i + 1, LANGUAGES[m.group(1)], marker, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return out


ALL = [s for page in PAGES for s in snippets(page)]


def test_every_fence_is_marked() -> None:
    unmarked = [f"{s.page.name}:{s.line}" for s in ALL if s.marker is None]
    assert not unmarked, f"fences without <!-- runs: Ns --> or <!-- example: why -->: {unmarked}"
    for s in ALL:
        kind, value = s.marker
        assert value, f"{s.page.name}:{s.line}: an empty {kind} marker"
        if kind == "runs":
            assert re.fullmatch(r"\d+s", value), f"{s.page.name}:{s.line}: runs: takes seconds, e.g. 20s"


def test_the_marker_check_catches_an_unmarked_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- runs: 3s -->\n```python\nprint(1)\n```\n\n```bash\necho hi\n```\n\n```\nplain\n```\n")
    found = snippets(page)
    assert [(s.language, s.marker) for s in found] == [("python", ("runs", "3s")), ("bash", None)]


def scratch_copy(tmp: Path) -> Path:
    """A working copy of the repository under tmp/repo: entries linked, docs/ copied (runs must not rewrite it),
    ../shared linked when present; what the docs write (runs/, model.onnx) lands in the copy."""
    repo = tmp / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name == "docs":
            shutil.copytree(entry, repo / "docs")
        elif entry.name not in ("runs", ".git"):
            (repo / entry.name).symlink_to(entry)
    if (ROOT.parent / "shared").is_dir():
        (tmp / "shared").symlink_to(ROOT.parent / "shared")
    return repo


def snippet_env() -> dict[str, str]:
    """The snippets' environment: this repository first on PYTHONPATH with the caller's entries kept (they may hold
    packages a snippet imports, e.g. the MiniLM weights), this venv first on PATH, offline, two threads."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.update(OMP_NUM_THREADS="2", TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def test_snippets_keep_the_callers_pythonpath(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert snippet_env()["PYTHONPATH"].split(os.pathsep) == [str(ROOT), str(tmp_path)]
    monkeypatch.delenv("PYTHONPATH")
    assert snippet_env()["PYTHONPATH"] == str(ROOT)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_runnable_snippets_run(page: Path, tmp_path: Path) -> None:
    runnable = [s for s in snippets(page) if s.marker and s.marker[0] == "runs"]
    if not runnable:
        pytest.skip(f"{page.name} has no runnable snippet")
    if any("../shared/data" in s.code for s in runnable) and not (ROOT.parent / "shared" / "data").is_dir():
        pytest.skip(f"{page.name}'s snippets read ../shared/data, absent here")
    repo = scratch_copy(tmp_path)
    env = snippet_env()
    for s in runnable:
        if s.language == "python":
            script = repo / f"snippet_{s.line}.py"
            script.write_text(s.code)
            cmd = [sys.executable, script.name]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", s.code]
        done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=max(60, 5 * s.seconds))
        output = done.stdout[-3000:] + done.stderr[-3000:]
        assert done.returncode == 0, f"{page.name}:{s.line} failed:\n{s.code}\n{output}"
