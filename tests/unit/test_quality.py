from bench.quality import parses, token_agreement, token_kind


def test_token_kinds():
    assert [token_kind(s) for s in ("  ", "\n", "):", " 42", " 'a", " name", " if", " a.b")] == [
        "whitespace",
        "whitespace",
        "punctuation",
        "literal",
        "literal",
        "identifier",
        "identifier",
        "other",
    ]


def test_parses_trims_a_cut_last_line_but_not_real_errors():
    assert parses("def f(x):\n", "    return x + 1\n\ndef g(y):\n    return (y")
    assert not parses("def f(x):\n", "    return x +* 1\n" + "    pass\n" * 10)


def test_token_agreement():
    assert token_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3]) == 0.5
