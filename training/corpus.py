"""Training corpus: the Python standard library of the running interpreter.

Rules:
- Every ``.py`` file under the stdlib directory (tests included), minus ``site-packages``,
  ``config-*`` and ``__pycache__``, sorted by path so the corpus is deterministic.
- The modules in ``HELD_OUT`` (and their ``test/test_<name>`` files) are never trained on;
  they are the ``stdlib-heldout`` and ``edit`` evaluation workloads.
- Edit documents (``make_edit_document``) are built deterministically from real source
  blocks: block, one instruction line naming the edits, the block rewritten with exactly
  those edits.
"""

from __future__ import annotations

import keyword
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Held out for evaluation, never trained on. A name matches a module file (`difflib.py`),
# a package directory (`json/`) and the test module `test/test_<name>.py` or `test/test_<name>/`.
HELD_OUT: tuple[str, ...] = (
    "bisect",
    "calendar",
    "colorsys",
    "csv",
    "difflib",
    "fractions",
    "graphlib",
    "heapq",
    "ipaddress",
    "json",
    "shlex",
    "statistics",
    "textwrap",
    "tomllib",
)

EOS = "<|endoftext|>"
EDIT_MARK = "# edit:"
END_MARK = "# end"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(rel: Path) -> bool:
    parts = rel.parts
    top = parts[0].removesuffix(".py")
    if top in HELD_OUT:
        return True
    if top == "test" and len(parts) > 1:
        name = parts[1].removesuffix(".py")
        return name.startswith("test_") and name[5:] in HELD_OUT
    return False


def source_files(split: str) -> list[Path]:
    """Sorted stdlib ``.py`` files of ``split`` ('train' or 'heldout')."""
    root = stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("site-packages",) or rel.parts[0].startswith("config-"):
            continue
        if "__pycache__" in rel.parts:
            continue
        if _is_held_out(rel) == (split == "heldout"):
            out.append(path)
    return out


def read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def source_document(path: Path) -> str:
    rel = path.relative_to(stdlib_root())
    return f"# file: {rel.as_posix()}\n{read_source(path) or ''}"


# ---------------------------------------------------------------------------------------
# Edit documents
# ---------------------------------------------------------------------------------------

_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
_INT = re.compile(r"(?<![\w.])\d{1,4}(?![\w.])")
_RENAME_SUFFIXES = ("_value", "_args", "_item", "_new", "_ref", "_data", "2", "_list")


@dataclass(frozen=True)
class EditDocument:
    path: str
    block: str  # original lines, newline-terminated
    instruction: str  # "# edit: ..." line, newline-terminated
    edited: str  # block with the edits applied, newline-terminated

    @property
    def prompt(self) -> str:
        return f"# file: {self.path}\n{self.block}{self.instruction}"

    @property
    def text(self) -> str:
        return f"{self.prompt}{self.edited}{END_MARK}\n"


def _pick_block(lines: list[str], rng: random.Random, max_chars: int) -> tuple[int, int] | None:
    if len(lines) < 40:
        return None
    for _ in range(8):
        start = rng.randrange(0, len(lines) - 30)
        want = rng.randint(30, 80)
        end = start
        size = 0
        while end < len(lines) and end - start < want and size + len(lines[end]) + 1 <= max_chars:
            size += len(lines[end]) + 1
            end += 1
        if end - start >= 20 and sum(1 for ln in lines[start:end] if ln.strip()) >= 15:
            return start, end
    return None


def _rename(block: list[str], rng: random.Random) -> tuple[str, str] | None:
    counts: dict[str, int] = {}
    for ln in block:
        if ln.lstrip().startswith("#"):
            continue
        for m in _IDENT.finditer(ln):
            counts[m.group()] = counts.get(m.group(), 0) + 1
    names = sorted(
        n
        for n, c in counts.items()
        if c >= 2 and not keyword.iskeyword(n) and n not in ("self", "cls", "None", "True", "False")
    )
    if not names:
        return None
    old = rng.choice(names)
    new = old + rng.choice(_RENAME_SUFFIXES)
    if new in counts:
        return None
    return old, new


def _literal_change(block: list[str], rng: random.Random) -> tuple[str, str] | None:
    found = sorted({m.group() for ln in block for m in _INT.finditer(ln) if not ln.lstrip().startswith("#")})
    if not found:
        return None
    old = rng.choice(found)
    new = str(int(old) + rng.randint(1, 9))
    return old, new


def make_edit_document(path: Path, rng: random.Random, max_chars: int = 1500) -> EditDocument | None:
    """One edit document from ``path``: a rename, a literal change, a deleted and an inserted line.

    The instruction states every edit; the edited block applies exactly those edits
    (rename and literal change on whole-word matches), so the output is predictable from
    the prompt alone.
    """
    text = read_source(path)
    if text is None or "\t" in text:
        return None
    lines = text.splitlines()
    span = _pick_block(lines, rng, max_chars)
    if span is None:
        return None
    block = lines[span[0] : span[1]]
    edits: list[str] = []
    new = list(block)
    rename = _rename(block, rng)
    if rename:
        old, repl = rename
        pat = re.compile(rf"\b{re.escape(old)}\b")
        new = [pat.sub(repl, ln) for ln in new]
        edits.append(f"rename {old} -> {repl}")
    lit = _literal_change(block, rng) if rng.random() < 0.7 else None
    if lit:
        old, repl = lit
        pat = re.compile(rf"(?<![\w.]){re.escape(old)}(?![\w.])")
        new = [ln if ln.lstrip().startswith("#") else pat.sub(repl, ln) for ln in new]
        edits.append(f"{old} -> {repl}")
    if rng.random() < 0.6:
        k = rng.randrange(len(new))
        edits.append(f"drop line {k + 1}")
        del new[k]
    if rng.random() < 0.5 and new:
        k = rng.randrange(len(new))
        indent = new[k][: len(new[k]) - len(new[k].lstrip())]
        added = f"{indent}# checked: {path.stem} line {k + 1}"
        edits.append(f"insert after line {k + 1}: {added.strip()}")
        new.insert(k + 1, added)
    if not edits:
        return None
    rel = path.relative_to(stdlib_root()).as_posix()
    return EditDocument(
        path=rel,
        block="\n".join(block) + "\n",
        instruction=f"{EDIT_MARK} {'; '.join(edits)}\n",
        edited="\n".join(new) + "\n",
    )


def edit_documents(split: str, per_lines: int = 250, seed: int = 0) -> list[EditDocument]:
    """Deterministic edit documents: about one per ``per_lines`` source lines of ``split``."""
    rng = random.Random(seed)
    docs = []
    for path in source_files(split):
        text = read_source(path)
        if text is None:
            continue
        n = max(0, text.count("\n") // per_lines)
        for _ in range(n):
            doc = make_edit_document(path, rng)
            if doc is not None:
                docs.append(doc)
    return docs


def training_texts(seed: int = 0) -> list[str]:
    """All training documents (sources + edit documents), in a seeded shuffled order."""
    texts = [source_document(p) for p in source_files("train") if read_source(p)]
    texts += [d.text for d in edit_documents("train", seed=seed)]
    random.Random(seed).shuffle(texts)
    return texts
