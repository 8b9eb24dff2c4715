"""The package corpus (training/packages.py): licences, the split by package, the file rules,
exact deduplication with the held-out copy kept, and the exported splits."""

import email.message
import hashlib
import importlib.metadata as md
from pathlib import Path

import pytest

from training.packages import (
    HELD_OUT_PACKAGES,
    document,
    export,
    licence_of,
    packages,
    read_documents,
    spdx_allows,
)


@pytest.mark.parametrize(
    "expr,ok",
    [
        ("MIT", True),
        ("Apache-2.0 OR BSD-3-Clause", True),
        ("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-2-Clause", True),
        ("MPL-2.0 AND MIT", False),
        ("GPL-3.0-or-later", False),
        ("MIT OR GPL-2.0", True),
        ("(MIT AND LGPL-2.1) OR Apache-2.0", True),
    ],
)
def test_spdx_expressions(expr, ok):
    assert spdx_allows(expr) is ok


def meta(**fields) -> email.message.Message:
    m = email.message.Message()
    for k, v in fields.items():
        for x in v if isinstance(v, list) else [v]:
            m[k.replace("_", "-")] = x
    return m


def test_licence_from_expression_classifier_or_free_text():
    assert licence_of(meta(License_Expression="BSD-3-Clause", License="GPL")) == "BSD-3-Clause"
    assert licence_of(meta(Classifier=["License :: OSI Approved :: Apache Software License"])) == "Apache-2.0"
    assert licence_of(meta(License="MPL-2.0 AND MIT")) == "MPL-2.0 AND MIT"  # an expression: refused
    assert licence_of(meta(License="Apache 2.0 License")) == "Apache-2.0"
    assert licence_of(meta(License="GPLv2")) == "GPL"
    assert licence_of(meta(Name="x")) is None


def dist(site: Path, name: str, files: dict[str, str], **fields) -> None:
    """A distribution in ``site``: its files and a dist-info whose RECORD lists them."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0"] + [
        f"{k.replace('_', '-')}: {v}" for k, v in fields.items()
    ]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))


@pytest.fixture
def site(tmp_path) -> Path:
    site = tmp_path / "site-packages"
    shared = "def shared():\n    return 1\n"
    held = HELD_OUT_PACKAGES[0]
    dist(
        site,
        "goodpkg",
        {
            "goodpkg/__init__.py": "x = 1\n",
            "goodpkg/copy.py": shared,
            "goodpkg/_vendor/other.py": "y = 2\n",
            "goodpkg/api_pb2.py": "z = 3\n",
            "goodpkg/data.py": "T = '" + "a" * 2000 + "'\n",
            "goodpkg/lib.so.py": "",
        },
        License_Expression="MIT",
    )
    dist(site, held, {f"{held}/core.py": shared, f"{held}/more.py": "w = 4\n"}, License="BSD-3-Clause")
    dist(
        site,
        "gplpkg",
        {"gplpkg/a.py": "v = 5\n"},
        Classifier="License :: OSI Approved :: GNU General Public License v3",
    )
    dist(site, "nolicence", {"nolicence/a.py": "u = 6\n"})
    return site


def test_packages_split_filter_and_deduplicate(site):
    pkgs = {p.name: p for p in packages(md.distributions(path=[str(site)]))}
    held = HELD_OUT_PACKAGES[0]
    assert set(pkgs) == {"goodpkg", held}  # copyleft and unknown licences left out
    assert pkgs[held].split == "heldout" and pkgs["goodpkg"].split == "train"
    assert sorted(f.name for f in pkgs[held].files) == ["core.py", "more.py"]
    # the shared text stays with the held-out package; vendored, generated, long-lined and empty files go
    assert [f.name for f in pkgs["goodpkg"].files] == ["__init__.py"]
    assert pkgs["goodpkg"].left_out == 5
    train = {hashlib.sha1(f.read_bytes()).digest() for f in pkgs["goodpkg"].files}
    assert not train & {hashlib.sha1(f.read_bytes()).digest() for f in pkgs[held].files}


def test_export_round_trip(site, tmp_path):
    pkgs = packages(md.distributions(path=[str(site)]))
    files = export(pkgs, tmp_path / "out", "<|endoftext|>")
    for split, path in files.items():
        want = [document(p, f) for p in pkgs if p.split == split for f in p.files]
        assert read_documents(path, "<|endoftext|>") == want
    assert read_documents(files["train"], "<|endoftext|>")[0] == "# file: goodpkg/__init__.py\nx = 1\n"


def test_the_installed_environment_gives_tens_of_millions_of_tokens_split_by_package():
    """The corpus `make setup`'s environment yields: train and held-out share no package and no
    file text, and the train split holds over 66 MB (20 M tokens at the tokenizer's 3.3
    characters per token, docs/corpus.md)."""
    pkgs = packages()
    train = [p for p in pkgs if p.split == "train"]
    held = [p for p in pkgs if p.split == "heldout"]
    assert {p.name for p in held} <= set(HELD_OUT_PACKAGES) and len(held) >= 4
    assert sum(p.bytes for p in train) > 66e6
    digests = {
        s: {hashlib.sha1(f.read_bytes()).digest() for p in ps for f in p.files} for s, ps in (("t", train), ("h", held))
    }
    assert not digests["t"] & digests["h"]


def test_only_directories_inside_a_distribution_count_as_vendored(tmp_path):
    """An environment that itself sits under a directory named like a vendored tree keeps its files."""
    site = tmp_path / "vendor" / "extern" / "site-packages"
    dist(site, "okpkg", {"okpkg/__init__.py": "a = 1\n", "okpkg/_vendor/b.py": "b = 2\n"}, License_Expression="MIT")
    (pkg,) = packages(md.distributions(path=[str(site)]))
    assert [f.name for f in pkg.files] == ["__init__.py"] and pkg.left_out == 1
