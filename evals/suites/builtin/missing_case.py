"""Built-in tasks whose bug is a case the code forgets: a unit, a zero, a notation, a type."""

from __future__ import annotations

from freetoken_agent.evals.suites.spec import SuiteTask

DURATION = SuiteTask(
    name="duration_seconds_unit",
    kind="missing-case",
    problem="""
        parse_duration crashes on seconds

        `parse_duration("45s")` raises `KeyError: 's'` and `parse_duration("1m5s")` too. Hours and minutes
        work (`"1h30m"` is 5400). Seconds should be supported: "45s" is 45, "1m5s" is 65.
    """,
    files={
        "timefmt/__init__.py": "",
        "timefmt/duration.py": '''
            import re

            _PART = re.compile(r"(\\d+)([hms])")
            _SECONDS = {"h": 3600, "m": 60}


            def parse_duration(text: str) -> int:
                """Seconds in a duration like '1h30m' or '45s'."""
                parts = _PART.findall(text)
                if not parts or "".join(n + u for n, u in parts) != text:
                    raise ValueError(f"not a duration: {text!r}")
                return sum(int(n) * _SECONDS[u] for n, u in parts)
        ''',
        "tests/test_duration.py": """
            import pytest

            from timefmt.duration import parse_duration


            def test_hours_minutes():
                assert parse_duration("1h30m") == 5400


            def test_garbage():
                with pytest.raises(ValueError):
                    parse_duration("abc")
        """,
    },
    fix={"timefmt/duration.py": [('{"h": 3600, "m": 60}', '{"h": 3600, "m": 60, "s": 1}')]},
    tests={"tests/test_duration.py": [("", """
        def test_seconds():
            assert parse_duration("45s") == 45
            assert parse_duration("1m5s") == 65
    """)]},
    fail_to_pass=["tests/test_duration.py::test_seconds"],
    pass_to_pass=["tests/test_duration.py::test_hours_minutes", "tests/test_duration.py::test_garbage"],
)

TAIL = SuiteTask(
    name="tail_zero_lines",
    kind="missing-case",
    problem="""
        tail(lines, 0) returns every line

        Asking for the last 0 lines should give an empty list, but `tail(["a", "b"], 0)` returns
        `["a", "b"]`.
    """,
    files={
        "textutil/__init__.py": "",
        "textutil/tail.py": '''
            def tail(lines: list[str], n: int) -> list[str]:
                """The last n lines (all of them when there are fewer than n)."""
                if n < 0:
                    raise ValueError("n must be >= 0")
                return lines[-n:]
        ''',
        "tests/test_tail.py": """
            from textutil.tail import tail


            def test_last_two():
                assert tail(["a", "b", "c"], 2) == ["b", "c"]


            def test_fewer_than_n():
                assert tail(["a"], 5) == ["a"]
        """,
    },
    fix={"textutil/tail.py": [("return lines[-n:]", "return lines[-n:] if n else []")]},
    tests={"tests/test_tail.py": [("", """
        def test_zero():
            assert tail(["a", "b"], 0) == []
    """)]},
    fail_to_pass=["tests/test_tail.py::test_zero"],
    pass_to_pass=["tests/test_tail.py::test_last_two", "tests/test_tail.py::test_fewer_than_n"],
)

ROMAN = SuiteTask(
    name="roman_subtractive",
    kind="missing-case",
    problem="""
        Roman numerals with subtractive notation are misread

        `to_int("XIV")` returns 16 instead of 14, and `to_int("MCMXCIV")` returns 2216 instead of 1994. A
        smaller numeral written before a larger one is subtracted.
    """,
    files={
        "numerals/__init__.py": "",
        "numerals/roman.py": '''
            VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


            def to_int(numeral: str) -> int:
                """Value of a Roman numeral such as 'XIV' or 'MCMXCIV'."""
                if not numeral or any(c not in VALUES for c in numeral):
                    raise ValueError(f"not a Roman numeral: {numeral!r}")
                return sum(VALUES[c] for c in numeral)
        ''',
        "tests/test_roman.py": """
            import pytest

            from numerals.roman import to_int


            def test_additive():
                assert to_int("XVI") == 16
                assert to_int("MMX") == 2010


            def test_invalid():
                with pytest.raises(ValueError):
                    to_int("ABC")
        """,
    },
    fix={"numerals/roman.py": [("    return sum(VALUES[c] for c in numeral)\n", """\
    total = 0
    for i, c in enumerate(numeral):
        if i + 1 < len(numeral) and VALUES[numeral[i + 1]] > VALUES[c]:
            total -= VALUES[c]
        else:
            total += VALUES[c]
    return total
""")]},
    tests={"tests/test_roman.py": [("", """
        def test_subtractive():
            assert to_int("XIV") == 14
            assert to_int("MCMXCIV") == 1994
    """)]},
    fail_to_pass=["tests/test_roman.py::test_subtractive"],
    pass_to_pass=["tests/test_roman.py::test_additive", "tests/test_roman.py::test_invalid"],
)

FLATTEN = SuiteTask(
    name="flatten_tuples",
    kind="missing-case",
    problem="""
        flatten() does not descend into tuples

        `flatten([1, (2, 3), [(4,)]])` returns `[1, (2, 3), (4,)]`; the docstring says nested lists and
        tuples are flattened, so the answer should be `[1, 2, 3, 4]`.
    """,
    files={
        "nested/__init__.py": "",
        "nested/flatten.py": '''
            def flatten(value: object) -> list:
                """All leaves of arbitrarily nested lists and tuples, left to right."""
                if isinstance(value, list):
                    out = []
                    for item in value:
                        out.extend(flatten(item))
                    return out
                return [value]
        ''',
        "tests/test_flatten.py": """
            from nested.flatten import flatten


            def test_lists():
                assert flatten([1, [2, [3]], 4]) == [1, 2, 3, 4]


            def test_strings_are_leaves():
                assert flatten(["ab", ["c"]]) == ["ab", "c"]
        """,
    },
    fix={"nested/flatten.py": [("isinstance(value, list)", "isinstance(value, (list, tuple))")]},
    tests={"tests/test_issue.py": """
        from nested.flatten import flatten


        def test_tuples():
            assert flatten([1, (2, 3), [(4,)]]) == [1, 2, 3, 4]
    """},
    fail_to_pass=["tests/test_issue.py::test_tuples"],
    pass_to_pass=["tests/test_flatten.py::test_lists", "tests/test_flatten.py::test_strings_are_leaves"],
)

RATIO = SuiteTask(
    name="ratio_zero_denominator",
    kind="missing-case",
    problem="""
        success_rate([]) raises ZeroDivisionError

        With no results `success_rate` should be 0.0, and `ratio(3, 0, default=-1.0)` should return the
        default as documented; both raise ZeroDivisionError.
    """,
    files={
        "metrics/__init__.py": "",
        "metrics/ratio.py": '''
            def ratio(part: float, whole: float, default: float = 0.0) -> float:
                """part / whole, or `default` when whole is zero (an empty denominator is not an error)."""
                return part / whole


            def success_rate(results: list[bool]) -> float:
                """Fraction of True values; 0.0 for no results."""
                return ratio(sum(results), len(results))
        ''',
        "tests/test_ratio.py": """
            from metrics.ratio import ratio, success_rate


            def test_ratio():
                assert ratio(1, 4) == 0.25


            def test_success_rate():
                assert success_rate([True, False]) == 0.5
        """,
    },
    fix={"metrics/ratio.py": [("    return part / whole\n", "    if whole == 0:\n        return default\n    return part / whole\n")]},
    tests={"tests/test_ratio.py": [("", """
        def test_zero_denominator():
            assert success_rate([]) == 0.0
            assert ratio(3, 0, default=-1.0) == -1.0
    """)]},
    fail_to_pass=["tests/test_ratio.py::test_zero_denominator"],
    pass_to_pass=["tests/test_ratio.py::test_ratio", "tests/test_ratio.py::test_success_rate"],
)

TASKS = [DURATION, TAIL, ROMAN, FLATTEN, RATIO]
