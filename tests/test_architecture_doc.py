"""docs/ARCHITECTURE.md stays true to the tree: every path it names exists, and every module it names
by file name is one of the repository's."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_every_path_named_exists():
    paths = set(re.findall(r"\b(?:services|protos|tests|scripts|deploy|docs)/[\w./*-]*\w", DOC))
    assert paths
    missing = sorted(path for path in paths if not any(ROOT.glob(path)))
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_every_file_named_exists():
    names = set(re.findall(r"`([\w/]+\.(?:py|cpp|proto|yml|md))`", DOC)) - {"DESIGN.md"}  # the team's, not here
    files = {path.name for path in ROOT.iterdir()}
    files |= {path.name for top in ("services", "protos", "tests", "scripts", "deploy", "docs")
              for path in (ROOT / top).rglob("*")}
    missing = sorted(name for name in names if Path(name).name not in files)
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"


def test_the_readme_links_it():
    assert "(docs/ARCHITECTURE.md)" in (ROOT / "README.md").read_text()
