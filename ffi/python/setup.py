"""Build hook: put libkvd inside the package, so an installed `kvd` needs no LD_LIBRARY_PATH.

The library comes from `KVD_LIBKVD` (a path to a built libkvd.so: what scripts/test.sh passes)
or, when that is unset, from `cargo build --release -p kvd-ffi` in the workspace this folder
lives in (`ffi/python` -> the repository root, two levels up).
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def libkvd() -> Path:
    given = os.environ.get("KVD_LIBKVD")
    if given:
        return Path(given)
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "kvd-ffi"], cwd=ROOT, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "libkvd.so"


class BuildWithLibkvd(build_py):
    def run(self) -> None:
        super().run()
        lib = libkvd()
        if not lib.is_file():
            raise SystemExit(f"libkvd not found at {lib}")
        dest = Path(self.build_lib) / "kvd" / "libkvd.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib, dest)


class BinaryDistribution(Distribution):
    """The wheel carries a native library: it is platform-specific."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildWithLibkvd}, distclass=BinaryDistribution)
