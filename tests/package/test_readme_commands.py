"""The commands CI runs are the commands the README's Quickstart shows: the install-and-train command exactly (cut to a
few steps by one ``trainer.max_steps`` override, nothing else) on a bare install, and the test command."""

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quickstart_commands() -> list[str]:
    quickstart = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quickstart, re.S)[:2]]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_install_and_train_command_with_only_a_step_limit_added():
    train, _ = _quickstart_commands()
    assert train == "pip install torch==2.13.0 -e . && python recipes/pretrain_gpt.py"  # no extra: the bare install
    runs = [line for line in _ci_lines() if line.startswith(train + " ")]
    assert len(runs) == 1, _ci_lines()
    added = shlex.split(runs[0][len(train):])
    assert len(added) == 1 and re.fullmatch(r"trainer\.max_steps=[1-9]\d*", added[0]), added


def test_ci_runs_the_readme_test_command_after_the_bare_job_each_in_a_new_environment():
    train, test = _quickstart_commands()
    lines = _ci_lines()
    assert test in lines
    bare = next(i for i, line in enumerate(lines) if line.startswith(train + " "))
    assert bare < lines.index(test)
    # A new virtual environment before each: the bare one inside its own subshell, so the test one starts clean.
    venvs = [i for i, line in enumerate(lines) if line.startswith("fresh_venv ")]
    assert len(venvs) == 2 and venvs[0] < bare < venvs[1] < lines.index(test)
    assert lines[venvs[0] - 1] == "(" and lines[bare + 1] == ")"
