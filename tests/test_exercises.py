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
