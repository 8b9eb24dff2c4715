"""ArcticInference's C++ suffix tree, built from its PyPI sdist for same-run comparisons.

Nothing of it is vendored or committed: ``build()`` downloads the sdist into ``.cache/arctic/``
(ignored by git), builds only ``csrc/suffix_decoding`` with CMake and nanobind in a virtual
environment of its own (the full package wants vLLM and a CUDA torch), and returns a directory
to put on ``sys.path`` that holds ``arctic_inference.suffix_decoding`` (its ``cache.py`` and the
built ``_C`` module). When something is missing (no network, no compiler, no CMake) it says
what and returns None; the benchmark then runs without the Arctic rows.
"""

from __future__ import annotations

import hashlib
import io
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

from services.common.types import Draft

VERSION = "0.3.0"
ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "arctic"
NANOBIND = "nanobind==2.9.2"  # what the sdist's build-system asks for


def _sdist_url() -> tuple[str, str]:
    """The sdist's address and sha256, from PyPI's simple index (PEP 503)."""
    index = "https://pypi.org/simple/arctic-inference/"
    with urllib.request.urlopen(index, timeout=30) as r:
        page = r.read().decode()
    found = re.search(rf'href="([^"#]*arctic_inference-{re.escape(VERSION)}\.tar\.gz)#sha256=([0-9a-f]+)"', page)
    if not found:
        raise RuntimeError(f"no arctic_inference-{VERSION}.tar.gz in {index}")
    return urllib.parse.urljoin(index, found[1]), found[2]


def _fetch(src: Path) -> None:
    """The sdist's suffix-decoding sources only, into ``src``."""
    url, sha256 = _sdist_url()
    with urllib.request.urlopen(url, timeout=60) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise RuntimeError(f"{url}: sha256 differs from the index's")
    prefix = f"arctic_inference-{VERSION}/"
    wanted = ("csrc/suffix_decoding/", "arctic_inference/suffix_decoding/", "LICENSE")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.isfile() and rel.startswith(wanted):
                out = src / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tar.extractfile(m).read())  # type: ignore[union-attr]


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def build() -> Path | None:
    """The importable directory, built once and then reused; None (with the reason printed)."""
    pkg = CACHE / f"pkg-{VERSION}"
    mod_dir = pkg / "arctic_inference" / "suffix_decoding"
    if list(mod_dir.glob("_C*.so")):
        return pkg
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        print("[arctic] skipped: building it needs cmake and a C++20 compiler", file=sys.stderr)
        return None
    src, venv = CACHE / f"src-{VERSION}", CACHE / "venv"
    try:
        if not (src / "csrc" / "suffix_decoding" / "CMakeLists.txt").exists():
            print(f"[arctic] fetching arctic-inference {VERSION}'s sdist from PyPI", file=sys.stderr)
            _fetch(src)
        if not (venv / "bin" / "python").exists():
            _run([sys.executable, "-m", "venv", str(venv)], "creating the build venv")
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", NANOBIND], f"pip install {NANOBIND}")
        print("[arctic] building csrc/suffix_decoding (CMake, nanobind)", file=sys.stderr)
        build_dir = CACHE / "build"
        _run(
            ["cmake", "-S", str(src / "csrc" / "suffix_decoding"), "-B", str(build_dir),
             f"-DPython_EXECUTABLE={venv / 'bin' / 'python'}", "-DCMAKE_BUILD_TYPE=Release"],
            "cmake configure",
        )  # fmt: skip
        _run(["cmake", "--build", str(build_dir), "-j", "2"], "cmake build")
    except Exception as e:  # noqa: BLE001 - any failure means: measure without Arctic, and say why
        print(f"[arctic] skipped: {e}", file=sys.stderr)
        return None
    mod_dir.mkdir(parents=True, exist_ok=True)
    (pkg / "arctic_inference" / "__init__.py").write_text("")
    for f in ("__init__.py", "cache.py"):
        shutil.copy(src / "arctic_inference" / "suffix_decoding" / f, mod_dir / f)
    for so in (CACHE / "build").glob("_C*.so"):
        shutil.copy(so, mod_dir / so.name)
    return pkg


def load():
    """Arctic's ``SuffixDecodingCache`` class, or None."""
    pkg = build()
    if pkg is None:
        return None
    sys.path.insert(0, str(pkg))
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # type: ignore[import-not-found]

    return SuffixDecodingCache


class ArcticDrafter:
    """Arctic's cache behind our drafter calls, as vLLM drives it: the prompt at start, each
    step's tokens appended to the request's tree and (in progress) to the shared tree, the
    context's tail matched afresh at every speculation."""

    name = "arctic"

    def __init__(self, cache_cls, max_depth: int, max_cached_requests: int, spec, tree: bool = False):
        self.cache = cache_cls(max_depth, max_cached_requests)
        self.max_depth, self.spec, self.tree = max_depth, spec, tree
        self.context: dict[str, list[int]] = {}

    def start(self, req_id, prompt, sp=None, rng=None, max_new_tokens=0) -> None:
        self.cache.start_request(req_id, prompt)
        self.context[req_id] = list(prompt)

    def propose(self, req_id: str, budget: int) -> Draft:
        p = self.spec
        d = self.cache.speculate(
            req_id,
            self.context[req_id][-self.max_depth :],
            min(budget, p.max_spec_tokens),
            p.max_spec_factor,
            p.max_spec_offset,
            p.min_token_prob,
            self.tree,
        )
        parents = list(d.parents) if self.tree else []
        return Draft(token_ids=list(d.token_ids), parents=parents, score=d.score, source=self.name)

    def observe(self, req_id: str, tokens: list[int], target_states=None) -> None:
        self.cache.add_active_response(req_id, tokens)
        self.context[req_id].extend(tokens)

    def stop(self, req_id: str) -> list[int]:
        self.cache.stop_request(req_id)
        self.context.pop(req_id, None)
        return []
