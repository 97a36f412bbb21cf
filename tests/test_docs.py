"""The user guide holds together: README.md stays a short front page (at most 300 lines) and
every relative link and anchor of README.md and docs/*.md resolves (tools/check_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "tools" / "check_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_docs_links_resolve(capsys):
    assert _check_docs().main(["--root", str(ROOT)]) == 0, capsys.readouterr().out


def test_a_broken_link_or_a_long_readme_is_found(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n[b](b.md) [self](#nope)\n")
    (tmp_path / "README.md").write_text("[a](docs/a.md#a)\n" + "line\n" * 300)
    assert _check_docs().main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "docs/a.md: b.md: no such file" in out
    assert "docs/a.md: #nope: no heading with that anchor" in out
    assert "README.md: 301 lines" in out
