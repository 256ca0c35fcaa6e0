"""The versions installed are versions the package declares as tested: every requirement of setup.cfg (install and
the test extra) with a version range holds for what is installed, so a fresh install cannot pick a release the
suite never ran on."""

import configparser
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"


def _requirements(section: str, key: str) -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(SETUP_CFG)
    return [Requirement(line) for line in config[section][key].splitlines() if line.strip()]


def test_every_installed_dependency_lies_in_its_declared_range():
    declared = _requirements("options", "install_requires") + _requirements("options.extras_require", "test")
    outside = [f"{r.name} {version(r.name)} not in {r.specifier}" for r in declared
               if r.specifier and not r.specifier.contains(version(r.name), prereleases=True)]
    assert outside == []


def test_the_fast_moving_extras_have_an_upper_bound():
    for extra in ("hf", "peft", "test"):
        for requirement in _requirements("options.extras_require", extra):
            if requirement.name in ("transformers", "safetensors", "tokenizers", "peft"):
                assert any(s.operator == "<" for s in requirement.specifier), requirement
