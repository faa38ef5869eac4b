"""The README stays true: its variable table matches opbuilder.env, its commands exist."""

from __future__ import annotations

import re

from conftest import ROOT
from opbuilder import env


def test_every_variable_is_in_the_readme_table() -> None:
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `([A-Z_<>]+)` \|", readme, flags=re.MULTILINE))
    assert table == set(env.VARIABLES), f"README table vs env.VARIABLES differ: {table ^ set(env.VARIABLES)}"


def test_the_two_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    demo, test = (line.split("#", 1)[0].strip() for line in block.strip().splitlines())
    assert demo == "./run demo" and test.startswith("./run test"), block
    assert test in (ROOT / ".ci" / "run").read_text().splitlines(), f"CI does not run the README's {test!r}"
