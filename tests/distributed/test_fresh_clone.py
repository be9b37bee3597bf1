"""The README's two commands in a fresh clone, on a system Python that refuses global installs (PEP 668).

`make demo` and `make test` must create `.venv` with that Python and install only there. To stay
lean, the packages already installed beside this test's own interpreter (torch, numpy, ...) are
offered to the new environment through PYTHONPATH, as a `--system-site-packages` base would offer
them: pip then finds its requirements satisfied instead of unpacking torch again, while towers
itself (kept out of that path) is installed into the clone's `.venv` by the Makefile.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from cli_support import clean_env

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(420)

# Installed beside this interpreter but not offered to the new .venv: towers itself (the Makefile
# must install it from the clone) and the installers (the .venv must use its own pip).
_NOT_SHARED = ("towers", "__editable__", "_towers", "pip", "setuptools", "wheel", "_distutils_hack",
               "pkg_resources", "distutils-precedence")

_PROBE = ("import json, os, sys, sysconfig; print(json.dumps({'version': list(sys.version_info[:2]), "
          "'venv': sys.prefix != sys.base_prefix, 'managed': os.path.isfile(os.path.join("
          "sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'))}))")


def _externally_managed_python() -> str | None:
    """Return a system Python of this test's version that refuses global installs (PEP 668), if any."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3")):
        if not candidate or not Path(candidate).exists():
            continue
        probe = subprocess.run([candidate, "-c", _PROBE], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            continue
        facts = json.loads(probe.stdout)
        if facts["managed"] and not facts["venv"] and tuple(facts["version"]) == sys.version_info[:2]:
            return candidate
    return None


def _shared_packages(target: Path) -> Path:
    target.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(_NOT_SHARED) and entry.suffix != ".pth" and entry.name != "__pycache__":
            (target / entry.name).symlink_to(entry)
    return target


def _make(clone: Path, *args: str, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def test_make_demo_and_make_test_in_a_fresh_clone_on_an_externally_managed_python(tmp_path):
    base = _externally_managed_python()
    if base is None:
        pytest.skip("no system Python of this version marked EXTERNALLY-MANAGED (PEP 668) on this machine")
    has_pip = subprocess.run([base, "-c", "import pip"], capture_output=True).returncode == 0
    if has_pip:  # the precondition: this Python refuses a global install
        refused = subprocess.run([base, "-m", "pip", "install", "--dry-run", "--no-index", "towers"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "externally-managed-environment" in refused.stdout + refused.stderr

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    assert not (clone / ".venv").exists()
    env = clean_env({"PYTHONPATH": str(_shared_packages(tmp_path / "shared")), "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    demo_dir = tmp_path / "demo"

    demo = _make(clone, "demo", f"PYTHON={base}",
                 f"DEMO_ARGS=--epochs 1 --scaling-repeats 0 --out-dir {demo_dir}", env=env, timeout_s=300)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert f"{base} -m venv" in demo.stdout and ".venv/bin/python -m pip install" in demo.stdout
    assert "test accuracy" in demo.stdout and (demo_dir / "history.csv").is_file()
    cfg = (clone / ".venv" / "pyvenv.cfg").read_text()
    assert f"home = {Path(base).parent}" in cfg  # the .venv was made from the externally-managed Python
    where = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", "import towers; print(towers.__file__)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(clone / "src" / "towers" / "__init__.py")  # installed from the clone

    test = _make(clone, "test", f"PYTHON={base}", "PYTEST_ARGS=-p no:cacheprovider tests/unit/test_cli_basics.py", "LINT=0",
                 env=env, timeout_s=240)
    assert test.returncode == 0, test.stdout[-3000:] + test.stderr[-3000:]
    assert "pip install" not in test.stdout  # .venv already set up: no second install
    assert ".venv/bin/python -m pytest" in test.stdout and " passed" in test.stdout
