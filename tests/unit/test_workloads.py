import ast

from bench import workloads
from training import corpus

SOURCE = '''
def short(x):
    """One line."""
    return x


class K:
    def method(self, a):
        """Two lines
        of docstring."""
        return a


def empty():
    """Nothing

    after it."""


def documented(a, b):
    """Add them.

    >>> documented(1, 2)
    3
    """
    return a + b
'''


class UserTurn:
    """A chat template stand-in: one user turn, then the assistant's."""

    def apply_chat_template(self, turns, tokenize, add_generation_prompt):
        assert len(turns) == 1 and turns[0]["role"] == "user" and add_generation_prompt
        return f"<user>{turns[0]['content']}</user><assistant>"


def test_documented_functions_cut_after_the_docstring_dedented_with_a_body_left_to_write():
    found = workloads._documented_functions(SOURCE)
    assert [line for line, _ in found] == [8, 20]  # not one-line docstrings, not empty bodies
    method = found[0][1]
    assert method.startswith("def method(self, a):\n") and method.endswith('of docstring."""\n')
    assert found[1][1].endswith('    3\n    """\n')
    for _, src in found:  # each prompt is a function its body would complete
        ast.parse(src + "    pass\n")


def test_functions_train_round_robins_the_training_split_only():
    prompts = workloads.load("functions-train", 300)
    assert len(prompts) == 300 and len({p.id for p in prompts}) == 300
    files = [p.id.rsplit(":", 1)[0] for p in prompts]
    assert len(set(files[:100])) == 100  # the first round takes one function per file
    heldout = {f.relative_to(corpus.stdlib_root()).as_posix() for f in corpus.source_files("heldout")}
    assert not heldout & set(files)
    assert all(len(p.text) <= 1200 and p.text.startswith(("def ", "async def ")) for p in prompts)
    assert "functions-train" not in workloads.EVALUATION


def test_functions_train_more_continues_the_first_set_without_overlap():
    first = {p.id for p in workloads.load("functions-train", workloads.FUNCTIONS_FIRST)}
    more = workloads.load("functions-train-more", 50)
    assert len(more) == 50 and not first & {p.id for p in more}
    assert [p.id for p in more] == [p.id for p in workloads.functions(workloads.FUNCTIONS_FIRST + 50)[-50:]]


def test_functions_train_rest_overlaps_neither_earlier_set():
    used = workloads.FUNCTIONS_FIRST + workloads.FUNCTIONS_MORE
    earlier = {p.id for p in workloads.load("functions-train", workloads.FUNCTIONS_FIRST)}
    earlier |= {p.id for p in workloads.load("functions-train-more", workloads.FUNCTIONS_MORE)}
    rest = workloads.load("functions-train-rest", 40)
    assert len(earlier) == used and len(rest) == 40 and not earlier & {p.id for p in rest}
    assert [p.id for p in rest] == [p.id for p in workloads.functions(used + 40)[-40:]]


def test_explain_train_asks_for_prose_about_the_training_functions():
    functions = workloads.load("functions-train", 30)
    explained = workloads.load("explain-train", 30, UserTurn())
    assert [p.id for p in explained] == [p.id for p in functions]
    for e, f in zip(explained, functions):
        assert e.text == f"<user>{workloads.EXPLAIN_TASK}\n\n```python\n{f.text}```</user><assistant>"
    assert "explain-train" not in workloads.EVALUATION


def test_load_gives_prompts_through_the_chat_template_when_asked():
    class Tok:
        def apply_chat_template(self, turns, tokenize, add_generation_prompt):
            return f"<user>{turns[0]['content']}</user><assistant>"

    plain = workloads.load("humaneval", 2)
    chat = workloads.load("humaneval", 2, Tok())
    assert [c.id for c in chat] == [p.id for p in plain]
    assert all(
        c.text == f"<user>{workloads.CODE_TASK}</user><assistant>```python\n{p.text}" for c, p in zip(chat, plain)
    )


def test_chat_asks_mmlu_questions_step_by_step_spanning_the_subjects_first():
    prompts = workloads.load("chat", 400)
    assert len(prompts) == 282 and len({p.id for p in prompts}) == 282  # every exemplar, once
    assert len({p.id.split("/")[0] for p in prompts[:57]}) == 57  # one per subject first
    for p in prompts:
        assert p.text.startswith("Q: ") and p.text.endswith(f"\nA: {workloads.STEP_BY_STEP}")
        assert "(A)" in p.text and "\nA: " not in p.message and "\n\nQ: " not in p.message
    asked = workloads.load("chat", 3, UserTurn())
    assert [a.text for a in asked] == [f"<user>{p.message}</user><assistant>" for p in prompts[:3]]
    assert "```" not in asked[0].text  # a question, not code to continue
    assert "chat" in workloads.EVALUATION
