"""constraints.txt pins every Python package `make install` brings besides torch and triton (the
Makefile pins those): a dependency added to pyproject.toml without a pin would let its next
release change CI's result, as xgrammar 0.2.9 once did."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PINNED_ELSEWHERE = {"torch", "triton"}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not name==version"
            pins[_name(name)] = version
    return pins


def test_every_dependency_is_pinned_and_torch_is_left_to_the_makefile():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    pins = _pins()
    missing = [r for r in wanted
               if _name(Requirement(r).name) not in pins | dict.fromkeys(PINNED_ELSEWHERE)]
    assert not missing, f"not pinned in constraints.txt: {missing}"
    assert not PINNED_ELSEWHERE & set(pins), "torch and triton are the Makefile's to pin"
    # each pin satisfies the range pyproject.toml asks for
    for text in wanted:
        req = Requirement(text)
        if _name(req.name) in pins:
            assert req.specifier.contains(pins[_name(req.name)], prereleases=True), (req, pins)
