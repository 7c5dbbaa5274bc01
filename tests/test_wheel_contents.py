"""What an installed (not editable) pagedgen holds: the image installs the wheel (`pip install .`
in docker/Dockerfile), and there every file the packages read at run time must come along: the
prefix index's Lua scripts, the CPU kernels' C++ sources. The wheel is built from the tracked
files alone, as a fresh clone would build it."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tracked files under the packages that an installed copy does not need: docs, results, and
# the GPU check's scripts (run from a checkout).
NOT_INSTALLED = ("*.md", "bench/results/*", "bench/*.sh")


def package_dirs() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in include]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode()
    return [name for name in out.split("\0") if name]


def build_wheel(tmp_path: Path) -> Path:
    source = tmp_path / "src"
    for name in tracked_files():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel")],
                   check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheel").glob("pagedgen-*.whl")
    return wheel


def test_the_wheel_carries_every_file_the_packages_read(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = tuple(f"{d}/" for d in package_dirs())
    wanted = {name for name in tracked_files() if name.startswith(packages)
              and not any(fnmatch.fnmatch(name, pattern) for pattern in NOT_INSTALLED)}
    assert any(name.endswith(".lua") for name in wanted)  # the check sees what it guards
    assert wanted - names == set(), f"not in the wheel: {sorted(wanted - names)}"

    # Installed on its own, away from this checkout: the index loads its scripts, the engine
    # finds the kernels' sources.
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import prefix_index, kernels.cpu_extension as ext;"
            "from prefix_index.server.scripts import load_scripts;"
            f"assert prefix_index.__file__.startswith({str(site)!r}), prefix_index.__file__;"
            "assert len(load_scripts('residency')) == 7;"
            "assert all(p.is_file() for p in ext.SOURCES + ext.HEADERS);"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done
