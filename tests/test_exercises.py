"""The exercise checker says right for right answers and gives the hint otherwise."""
from nanodist.exercises import check, is_right


def test_is_right():
    assert is_right(19, 19) and not is_right(18, 19) and not is_right(..., 19)
    assert is_right([1, 5], (1, 5)) and not is_right((1, 5, 0), (1, 5))
    assert is_right(6, 6.0) and is_right(0.1 + 0.2, 0.3) and not is_right("six", 6.0)


def test_check_prints_verdict_and_hint(capsys):
    check(..., 19, hint="multiply")
    check(18, 19, hint="multiply")
    check(19, 19, hint="multiply")
    assert capsys.readouterr().out.splitlines() == [
        "Not answered yet. Hint: multiply", "Not quite (18). Hint: multiply", "Right!"]


def test_registered_answers_are_checked_without_showing_them(capsys):
    import pytest

    from nanodist.exercises import expect
    expect("t.1", 42.0, rel_tol=1e-3)
    expect("t.2", cases=[((2, 3), 5), ((10, 1), 11)])
    check(42.01, exercise="t.1", hint="h")
    check(41, exercise="t.1", hint="h")
    check(lambda a, b: a + b, exercise="t.2", hint="add")
    check(lambda a, b: a * b, exercise="t.2", hint="add")
    check(7, exercise="t.2", hint="add")
    check(lambda a, b: ..., exercise="t.2", hint="add")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Right!" and out[1] == "Not quite (41). Hint: h" and out[2] == "Right!"
    assert out[3] == "Not quite (wrong for inputs (2, 3): got 6). Hint: add"
    assert out[4] == "Not quite (7) (the answer is a function). Hint: add"
    assert out[5] == "Not answered yet. Hint: add"
    assert not any("42" in line or "5)" in line for line in out[1:])  # a wrong answer never shows the right one
    with pytest.raises(KeyError, match="run the chapter's cells in order"):
        check(1, exercise="t.unknown", hint="")
    with pytest.raises(ValueError):
        expect("t.3")
