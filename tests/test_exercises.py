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


def test_every_chapter_has_exercises_that_hide_their_answers():
    """At least 3 exercises a chapter. Each: a hidden cell (removed from the page) registers the expected value; the
    reader's cell holds the blank and a check by key, never the value; the solution comes after, collapsed."""
    import json
    import re
    from pathlib import Path
    book = Path(__file__).resolve().parents[1] / "book"
    chapters = sorted(book.glob("[0-9][0-9]_*.ipynb"))
    assert len(chapters) >= 6
    for nb in chapters:
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        src = ["".join(c["source"]) for c in cells]
        tags = [c.get("metadata", {}).get("tags", []) for c in cells]
        keys = re.findall(r"""expect\(["']([\d.]+)["']""", "\n".join(src))
        assert len(keys) >= 3, f"{nb.name}: {len(keys)} exercises"
        for s in src:
            assert not ("check(" in s and "expected=" in s), f"{nb.name}: a check shows its expected value:\n{s}"
        for key in keys:
            where = lambda pred: [i for i, s in enumerate(src) if pred(s)]  # noqa: E731
            hidden = where(lambda s: re.search(rf"""expect\(["']{re.escape(key)}["']""", s))
            checks = where(lambda s: re.search(rf"""exercise=["']{re.escape(key)}["']""", s))
            assert len(hidden) == 1 and "remove-cell" in tags[hidden[0]], f"{nb.name} {key}: hidden cell"
            reader = [i for i in checks if "hide-input" not in tags[i]]
            solution = [i for i in checks if "hide-input" in tags[i]]
            assert len(reader) == 1 and len(solution) == 1, f"{nb.name} {key}: one reader cell and one solution"
            assert hidden[0] < reader[0] < solution[0], f"{nb.name} {key}: order hidden, reader, solution"
            r = src[reader[0]]
            near = "".join(src[max(reader[0] - 2, 0):reader[0] + 1])  # the blank: this cell or a stub before it
            assert re.search(r"answer = \.\.\.|return \.\.\.|\.\.\.  #", near), f"{nb.name} {key}: no blank"
            hint = re.search(r"""hint=(['"])(.*?)\1\)""", r, re.S)
            assert hint and hint.group(2).strip(), f"{nb.name} {key}: no hint"
            given = re.search(r"^answer = (.+?)(?:  #.*)?$", src[solution[0]], re.M)
            if given:  # the hint does not spell out the solution's expression
                assert given.group(1).replace(" ", "") not in hint.group(2).replace(" ", ""), f"{nb.name} {key}"


def test_a_prediction_is_compared_with_the_measurement_only_once_it_is_made(capsys):
    from nanodist.exercises import compare
    compare(..., (5, 3), exercise="t.p", hint="count per unit")
    compare((5, 3), [5, 3], exercise="t.p", hint="count per unit")
    compare((4, 3), (5, 3), exercise="t.p", hint="count per unit")
    compare(0.1 + 0.2, 0.3, exercise="t.p", hint="h")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Exercise t.p: write your prediction first (replace the ...), then run this cell again. " \
                     "Hint: count per unit"
    assert "5" not in out[0]  # nothing measured is shown before the reader has predicted
    assert out[1] == "Right! You predicted (5, 3); this machine measured [5, 3]."
    assert out[2] == "Not quite: you predicted (4, 3); this machine measured (5, 3). Hint: count per unit"
    assert out[3].startswith("Right!")
    compare((5, 3), (5, 3), exercise="t.p", hint="h", reveal=False)  # a folded solution: its output stays shown
    compare((4, 3), (5, 3), exercise="t.p", hint="count per unit", reveal=False)
    assert capsys.readouterr().out.splitlines() == ["Right!", "Not quite. Hint: count per unit"]


def test_predict_then_run_exercises_ask_first_run_then_hide_the_solution():
    """Every chapter has at least two predict-then-run exercises: the reader's blank prediction, then the visible
    run that measures and compares with a hint, then the collapsed solution; the run cell never holds the
    prediction's value, and its committed output (run before any prediction) shows only what to do; the solution,
    whose output stays on the page when its code is folded, says only "Right!"."""
    import json
    import re
    from pathlib import Path
    book = Path(__file__).resolve().parents[1] / "book"
    found = 0
    for nb in sorted(book.glob("[0-9][0-9]_*.ipynb")):
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        src = ["".join(c["source"]) for c in cells]
        tags = [c.get("metadata", {}).get("tags", []) for c in cells]
        keys = sorted(set(re.findall(r"""compare\(prediction, measured, exercise=["']([\d.]+)["']""", "\n".join(src))))
        assert len(keys) >= 2, f"{nb.name}: {len(keys)} predict-then-run exercise(s), at least 2 wanted"
        for key in keys:
            found += 1
            at = [i for i, s in enumerate(src) if re.search(rf"""exercise=["']{re.escape(key)}["']""", s)]
            run = [i for i in at if "hide-input" not in tags[i]]
            solution = [i for i in at if "hide-input" in tags[i]]
            assert len(run) == 1 and len(solution) == 1 and run[0] < solution[0], f"{nb.name} {key}"
            assert re.match(r"prediction = \.\.\.", src[run[0] - 1]), f"{nb.name} {key}: no blank before the run"
            assert "measured =" in src[run[0]] and "prediction =" not in src[run[0]], f"{nb.name} {key}"
            shown = "".join("".join(o.get("text", "")) for o in cells[run[0]].get("outputs", []))
            assert shown.startswith(f"Exercise {key}: write your prediction first") and shown.count("\n") == 1, \
                f"{nb.name} {key}: the committed run shows more than what to do: {shown!r}"
            hint = re.search(r"""hint=(['"])(.*?)\1\)""", src[run[0]], re.S)
            assert hint and hint.group(2).strip(), f"{nb.name} {key}: no hint"
            folded = "".join("".join(o.get("text", "")) for o in cells[solution[0]].get("outputs", []))
            assert folded == "Right!\n", f"{nb.name} {key}: a folded solution's output stays on the page: {folded!r}"
            given = re.search(r"^prediction = (.+)$", src[solution[0]], re.M)
            assert given and given.group(1).replace(" ", "") not in hint.group(2).replace(" ", ""), f"{nb.name} {key}"
    assert found >= 12


def test_answers_and_solutions_are_hidden_on_colab_too():
    """The web page hides them by tag and JupyterLab by source_hidden; Colab reads neither, so every expected-answer
    cell and every solution is also a Colab form: a `#@title` first line and cellView "form" (its code folded)."""
    import json
    import re
    from pathlib import Path
    book = Path(__file__).resolve().parents[1] / "book"
    for nb in sorted(book.glob("[0-9][0-9]_*.ipynb")):
        for c in json.loads(nb.read_text())["cells"]:
            src, meta = "".join(c["source"]), c.get("metadata", {})
            tags = meta.get("tags", [])
            secret = ("remove-cell" in tags and re.search(r"\bexpect\(", src)) or (
                "hide-input" in tags and re.search(r"\b(check|compare)\(", src))
            if c["cell_type"] == "code" and secret:
                assert src.startswith("#@title") and meta.get("cellView") == "form", f"{nb.name}: {src[:60]!r}"
                assert meta.get("jupyter", {}).get("source_hidden") is True, f"{nb.name}: {src[:60]!r}"
