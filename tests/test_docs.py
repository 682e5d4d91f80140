"""The docs stay true to the code: the configuration page is the generated one, and the API
reference covers every public name."""

import re
import subprocess
import sys

import commlib
from conftest import ROOT, base_env

DOCS = ROOT / "docs"


def test_configuration_page_is_generated_from_the_option_table():
    proc = subprocess.run([sys.executable, "-m", "commlib.config", "--markdown"], cwd=ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    on_disk = (DOCS / "configuration.md").read_text()
    assert on_disk == proc.stdout, (
        "docs/configuration.md is out of date with commlib/config/__init__.py. Fix: "
        "python -m commlib.config --markdown > docs/configuration.md")


def test_configuration_page_lists_every_option():
    from commlib.config import OPTIONS

    text = (DOCS / "configuration.md").read_text()
    for opt in OPTIONS.values():
        assert f"`{opt.env}`" in text, opt.env


def test_api_reference_covers_every_public_name():
    text = (DOCS / "api.md").read_text()
    headings = set(re.findall(r"^#{2,4} `?([A-Za-z_][A-Za-z0-9_.]*)", text, flags=re.M))
    missing = [name for name in commlib.__all__ if name not in headings]
    assert not missing, f"docs/api.md has no section for {missing}"


def test_readme_keeps_the_two_commands_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = "\n".join(lines[:6])
    assert block.index("make bench") < block.index("make test"), block
