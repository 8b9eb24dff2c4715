"""The package corpus: Python sources of the distributions installed beside the project, under
permissive licences, split into train and held-out by package.

Rules:
- A distribution is taken when its licence is permissive (``PERMISSIVE``): the SPDX
  ``License-Expression``, else its ``License ::`` classifiers, else a ``License`` field that
  names one. Copyleft (GPL, LGPL, AGPL, MPL) and unknown licences are left out, and so is this
  project itself.
- Its ``.py`` files, less generated code (``*_pb2*.py``), vendored copies of other packages
  (``_vendor/``, ``vendored/``, ``extern/``, ``third_party/``, ...), files over 512 KB and files with a
  line over 1,000 characters (data, minified); past ``MAX_PACKAGE_BYTES`` of a package's text,
  a seeded sample of its files up to that size.
- ``HELD_OUT_PACKAGES`` are never trained on; every other distribution is training data.
- Exact duplicates (same text) are kept once, the held-out copy first, so no held-out file is
  also a training file.

Pure: the standard library only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

# SPDX ids whose terms allow training on and shipping weights learnt from the text.
PERMISSIVE = {
    "0BSD",
    "Apache-2.0",
    "BSD",
    "BSD-2-Clause",
    "BSD-3-Clause",
    "BSL-1.0",
    "CC0-1.0",
    "CNRI-Python",
    "HPND",
    "ISC",
    "MIT",
    "MIT-0",
    "MIT-CMU",
    "PSF-2.0",
    "Unlicense",
    "Zlib",
}
# `License ::` classifiers and free-text `License` fields, as SPDX ids (first match wins).
_NAMES = [
    (re.compile(r"\bMIT\b"), "MIT"),
    (re.compile(r"apache", re.I), "Apache-2.0"),
    (re.compile(r"\bBSD\b.*3|3-Clause BSD", re.I), "BSD-3-Clause"),
    (re.compile(r"\bBSD\b.*2", re.I), "BSD-2-Clause"),
    (re.compile(r"\bBSD\b"), "BSD"),
    (re.compile(r"Python Software Foundation|\bPSF\b"), "PSF-2.0"),
    (re.compile(r"\bISC\b"), "ISC"),
    (re.compile(r"Mozilla|MPL"), "MPL-2.0"),
    (re.compile(r"\bL?GPL|General Public", re.I), "GPL"),
]
# Held out by package: a few mid-sized pure-Python libraries the project's environment has.
HELD_OUT_PACKAGES = ("attrs", "click", "h11", "idna", "jsonschema", "pyparsing", "python-dateutil", "rich")
SKIP_DIRS = {"_vendor", "vendor", "vendored", "_vendored", "extern", "thirdparty_files", "third_party", "__pycache__"}
MAX_FILE_BYTES = 512 * 1024
# At most this much text per package: transformers' and torch's sources would otherwise be 40 %
# of the corpus (much of it near-copies), and the compressed corpus must travel to the GPU
# machine beside the repository (64 MiB in all).
MAX_PACKAGE_BYTES = 8 * 10**6
MAX_LINE_CHARS = 1000


def spdx_allows(expression: str) -> bool:
    """A permissive SPDX expression: each alternative of a top-level OR is enough; every id of
    an AND (a ``WITH`` exception aside) must be permissive."""
    text = expression.replace("(", " ").replace(")", " ")
    return any(
        all(tok in PERMISSIVE for tok in re.split(r"\s+AND\s+", alt.split(" WITH ")[0].strip()) if tok)
        for alt in re.split(r"\s+OR\s+", text)
    )


_SPDX = re.compile(r"^[A-Za-z0-9.+-]+(\s+(AND|OR)\s+[A-Za-z0-9.+-]+)*$")


def _spdx_id(token: str) -> bool:
    return token in PERMISSIVE or re.match(r"^(MPL|L?GPL|AGPL)-\d", token) is not None


def licence_of(meta) -> str | None:
    """The distribution's licence as SPDX (an expression where it gives one); None if unknown."""
    if expr := (meta.get("License-Expression") or "").strip():
        return expr
    classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    free = (meta.get("License") or "").strip().splitlines()[:1]
    if free and _SPDX.match(free[0]) and all(_spdx_id(t) for t in re.split(r"\s+(?:AND|OR)\s+", free[0])):
        return free[0]  # an SPDX expression in the free-text field ("MPL-2.0 AND MIT")
    for text in classifiers + free:
        for pattern, spdx in _NAMES:
            if pattern.search(text):
                return spdx
    return None


@dataclass
class Package:
    name: str
    version: str
    licence: str
    split: str  # "train" or "heldout"
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    left_out: int = 0  # .py files dropped by a rule (generated, vendored, too big, duplicate)


def _usable(path: Path, rel: Path) -> str | None:
    """The file's text (``rel``: its path inside the distribution's install root), or None if a
    rule leaves it out."""
    if set(rel.parts) & (SKIP_DIRS | {".."}) or re.search(r"_pb2(_grpc)?\.py$", path.name):
        return None
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or max(map(len, text.splitlines()), default=0) > MAX_LINE_CHARS:
        return None
    return text


def packages(dists: Iterable[md.Distribution] | None = None) -> list[Package]:
    """The corpus's distributions with their kept files, held-out ones first, by name."""
    seen_names: set[str] = set()
    chosen: list[tuple[Package, md.Distribution]] = []
    for dist in dists if dists is not None else md.distributions():
        name = dist.metadata["Name"]
        if not name or name.lower() in seen_names or name == "specmesh":
            continue
        seen_names.add(name.lower())
        lic = licence_of(dist.metadata)
        if lic is None or not spdx_allows(lic):
            continue
        split = "heldout" if name in HELD_OUT_PACKAGES else "train"
        chosen.append((Package(name, dist.version, lic, split), dist))
    chosen.sort(key=lambda pd: (pd[0].split != "heldout", pd[0].name.lower()))
    seen_text: set[bytes] = set()
    for pkg, dist in chosen:
        kept: list[tuple[Path, int]] = []
        for rel in sorted(str(f) for f in dist.files or [] if str(f).endswith(".py")):
            path = Path(str(dist.locate_file(rel)))
            text = _usable(path, Path(rel))
            digest = hashlib.sha1(text.encode()).digest() if text is not None else b""
            if text is None or digest in seen_text:
                pkg.left_out += 1
                continue
            seen_text.add(digest)
            kept.append((path, len(text.encode())))
        random.Random(pkg.name).shuffle(kept)  # past the cap, a seeded sample of the package's files
        for path, size in kept:
            if pkg.bytes + size > MAX_PACKAGE_BYTES:
                pkg.left_out += 1
                continue
            pkg.files.append(path)
            pkg.bytes += size
        pkg.files.sort()
    return [pkg for pkg, _ in chosen if pkg.files]


def card(pkgs: list[Package], chars_per_token: float) -> str:
    """The corpus card's package table (markdown): every package, its licence and split."""
    lines = [
        "| package | version | licence | split | files | MB | tokens (est.) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in pkgs:
        lines.append(
            f"| {p.name} | {p.version} | {p.licence} | {p.split} | {len(p.files)} | "
            f"{p.bytes / 1e6:.2f} | {p.bytes / chars_per_token / 1e6:.2f} M |"
        )
    for split in ("train", "heldout"):
        total = sum(p.bytes for p in pkgs if p.split == split)
        lines.append(f"| **{split}** | | | | | {total / 1e6:.1f} | {total / chars_per_token / 1e6:.1f} M |")
    return "\n".join(lines)


def document(pkg: Package, path: Path) -> str:
    """A file as a training document: its path inside its package, then its text."""
    root = next((parent for parent in path.parents if parent.name in ("site-packages", "dist-packages")), path.parent)
    return f"# file: {path.relative_to(root).as_posix()}\n{path.read_text(encoding='utf-8')}"


def write_documents(path: Path, docs: Iterable[str], eos: str) -> None:
    """An xz file of documents, each followed by ``eos`` and a newline (``read_documents``),
    written under a temporary name and renamed."""
    import lzma

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
        for doc in docs:
            f.write(doc + eos + "\n")
    tmp.replace(path)


def export(pkgs: list[Package], out: Path, eos: str) -> dict[str, Path]:
    """``packages-{train,heldout}.txt.xz`` in ``out``: each split's documents (what the GPU
    machine tokenizes), with a progress line per package."""
    import time

    files = {}
    total, t0 = sum(p.bytes for p in pkgs), time.time()
    done = 0

    def docs(split: str):
        nonlocal done
        for pkg in (p for p in pkgs if p.split == split):
            yield from (document(pkg, path) for path in pkg.files)
            done += pkg.bytes
            rate = done / max(time.time() - t0, 1e-9)
            print(
                f"[corpus] {done / 1e6:.0f}/{total / 1e6:.0f} MB, {rate / 1e6:.1f} MB/s, "
                f"ETA {(total - done) / rate:.0f} s ({pkg.name})",
                flush=True,
            )

    for split in ("train", "heldout"):
        files[split] = out / f"packages-{split}.txt.xz"
        write_documents(files[split], docs(split), eos)
    return files


def read_documents(path: Path, eos: str) -> list[str]:
    """The documents of an ``export`` file."""
    import lzma

    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [doc.removeprefix("\n") for doc in f.read().split(eos) if doc.strip()]


CARD_HEAD = """# Corpus card: the package corpus

Made by `python -m training.packages` from the distributions installed by `make setup`
(`training/packages.py` states the rules). Training data for the next model pair: the standard
library's training split (`training/corpus.py`) plus the train packages below. The held-out
packages are never trained on; the standard library's held-out modules stay the gate's
held-out set, so losses compare with today's models'.

- Licences: permissive only ({permissive}). Left out for their licence (copyleft: GPL, LGPL,
  AGPL, MPL; unknown; this project): {refused}. Permissive but with no Python sources kept:
  {empty}.
- Left out inside a package ({left_out:,} files): generated protobuf code, vendored copies of
  other packages, files over 512 KB or with a line over 1,000 characters, exact duplicates,
  and past 8 MB of a package's text, all but a seeded sample of its files up to 8 MB.
- Tokens are estimated at {cpt:.2f} characters per token of the bundled tokenizer (measured on
  {sample} files of the corpus).

"""


def main() -> None:
    import argparse

    from transformers import AutoTokenizer

    from training.corpus import EOS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path("build/corpus"), help="where the .txt.xz splits go (packages, stdlib)"
    )
    ap.add_argument("--card", type=Path, default=Path("docs/corpus.md"))
    ap.add_argument("--tokenizer", type=Path, default=Path("models/tokenizer"))
    ap.add_argument("--card-only", action="store_true", help="write the card, not the splits")
    a = ap.parse_args()
    all_dists = list(md.distributions())
    pkgs = packages(all_dists)
    kept = {p.name for p in pkgs}
    licences = {d.metadata["Name"]: licence_of(d.metadata) for d in all_dists}
    refused = sorted(f"{n} ({lic or 'unknown'})" for n, lic in licences.items() if lic is None or not spdx_allows(lic))
    empty = sorted(n for n, lic in licences.items() if lic and spdx_allows(lic) and n not in kept)
    files = [f for p in pkgs for f in p.files]
    sample = random.Random(0).sample(files, min(300, len(files)))
    tok = AutoTokenizer.from_pretrained(str(a.tokenizer))
    texts = [f.read_text(encoding="utf-8") for f in sample]
    cpt = sum(map(len, texts)) / sum(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"])
    head = CARD_HEAD.format(
        permissive=", ".join(sorted(PERMISSIVE)),
        refused=", ".join(refused),
        empty=", ".join(empty),
        left_out=sum(p.left_out for p in pkgs),
        cpt=cpt,
        sample=len(sample),
    )
    a.card.write_text(head + card(pkgs, cpt) + "\n")
    print(f"wrote {a.card}")
    if not a.card_only:
        from training.corpus import source_document, source_files, training_texts

        files = export(pkgs, a.out, EOS)
        # the standard library's splits too, so the GPU machine trains and evaluates on ours
        files["stdlib train"] = a.out / "stdlib-train.txt.xz"
        write_documents(files["stdlib train"], training_texts(), EOS)
        files["stdlib heldout"] = a.out / "stdlib-heldout.txt.xz"
        write_documents(files["stdlib heldout"], (source_document(p) for p in source_files("heldout")), EOS)
        for path in files.values():
            print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
