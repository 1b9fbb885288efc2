"""Built-in tasks whose bug is a wrong condition: a missing clause, operator precedence, a strict comparison."""

from __future__ import annotations

from freetoken_agent.evals.suites.spec import SuiteTask

LEAP_YEAR = SuiteTask(
    name="leap_year_400",
    kind="wrong-condition",
    problem="""
        Year 2000 is reported as a common year

        `is_leap(2000)` returns False and `days_in_february(2000)` returns 28. Years divisible by 400 are
        leap years in the Gregorian calendar.
    """,
    files={
        "dates/__init__.py": "",
        "dates/leap.py": '''
            def is_leap(year: int) -> bool:
                """True for leap years of the Gregorian calendar."""
                return year % 4 == 0 and year % 100 != 0


            def days_in_february(year: int) -> int:
                return 29 if is_leap(year) else 28
        ''',
        "tests/test_leap.py": """
            from dates.leap import days_in_february, is_leap


            def test_common_rules():
                assert not is_leap(2023)
                assert is_leap(2024)
                assert not is_leap(1900)
                assert days_in_february(2023) == 28
        """,
    },
    fix={"dates/leap.py": [("year % 4 == 0 and year % 100 != 0",
                            "year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)")]},
    tests={"tests/test_leap.py": [("", """
        def test_divisible_by_400():
            assert is_leap(2000)
            assert days_in_february(2000) == 29
    """)]},
    fail_to_pass=["tests/test_leap.py::test_divisible_by_400"],
    pass_to_pass=["tests/test_leap.py::test_common_rules"],
)

PASSWORD = SuiteTask(
    name="password_policy_precedence",
    kind="wrong-condition",
    problem="""
        Any password with an upper-case letter is accepted as strong

        `is_strong("A")` and `is_strong("Abcdefgh")` return True. A strong password must be at least 8
        characters long AND contain a digit AND an upper-case letter.
    """,
    files={
        "accounts/__init__.py": "",
        "accounts/policy.py": '''
            def is_strong(password: str) -> bool:
                """A strong password has at least 8 characters, a digit and an upper-case letter."""
                long_enough = len(password) >= 8
                has_digit = any(c.isdigit() for c in password)
                has_upper = any(c.isupper() for c in password)
                return long_enough and has_digit or has_upper
        ''',
        "tests/test_policy.py": """
            from accounts.policy import is_strong


            def test_strong():
                assert is_strong("Secret123")


            def test_weak():
                assert not is_strong("abc")
        """,
    },
    fix={"accounts/policy.py": [("long_enough and has_digit or has_upper", "long_enough and has_digit and has_upper")]},
    tests={"tests/test_policy.py": [("", """
        def test_upper_case_alone_is_not_enough():
            assert not is_strong("A")
            assert not is_strong("Abcdefgh")
            assert not is_strong("abcdefg1")
    """)]},
    fail_to_pass=["tests/test_policy.py::test_upper_case_alone_is_not_enough"],
    pass_to_pass=["tests/test_policy.py::test_strong", "tests/test_policy.py::test_weak"],
)

GRADES = SuiteTask(
    name="grade_cutoffs_inclusive",
    kind="wrong-condition",
    problem="""
        A score of exactly 90 gets a B

        `letter(90)` returns "B" and `letter(60)` returns "F", but the docstring says 90 and above is an A,
        80 and above a B, and so on down to 60 for a D.
    """,
    files={
        "school/__init__.py": "",
        "school/grades.py": '''
            CUTOFFS = [(90, "A"), (80, "B"), (70, "C"), (60, "D")]


            def letter(score: float) -> str:
                """Letter grade: 90 and above is an A, 80 and above a B, ..., below 60 an F."""
                if not 0 <= score <= 100:
                    raise ValueError(f"score out of range: {score}")
                for cutoff, grade in CUTOFFS:
                    if score > cutoff:
                        return grade
                return "F"
        ''',
        "tests/test_grades.py": """
            import pytest

            from school.grades import letter


            def test_clear_cases():
                assert letter(95) == "A"
                assert letter(10) == "F"


            def test_out_of_range():
                with pytest.raises(ValueError):
                    letter(101)
        """,
    },
    fix={"school/grades.py": [("if score > cutoff:", "if score >= cutoff:")]},
    tests={"tests/test_issue.py": """
        from school.grades import letter


        def test_cutoffs_are_inclusive():
            assert letter(90) == "A"
            assert letter(80) == "B"
            assert letter(60) == "D"
            assert letter(59.5) == "F"
    """},
    fail_to_pass=["tests/test_issue.py::test_cutoffs_are_inclusive"],
    pass_to_pass=["tests/test_grades.py::test_clear_cases", "tests/test_grades.py::test_out_of_range"],
)

MERGE_INTERVALS = SuiteTask(
    name="merge_touching_intervals",
    kind="wrong-condition",
    problem="""
        merge() keeps touching intervals apart

        `merge([(1, 2), (2, 4)])` returns `[(1, 2), (2, 4)]`; the intervals are closed and share the point 2,
        so the answer should be `[(1, 4)]`. Same for `merge([(5, 7), (1, 5)])`, which should be `[(1, 7)]`.
    """,
    files={
        "spans/__init__.py": "from spans.merge import merge\n",
        "spans/merge.py": '''
            def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
                """Merge overlapping or touching closed intervals; the result is sorted."""
                out: list[tuple[int, int]] = []
                for start, end in sorted(intervals):
                    if out and start < out[-1][1]:
                        out[-1] = (out[-1][0], max(out[-1][1], end))
                    else:
                        out.append((start, end))
                return out
        ''',
        "tests/test_merge.py": """
            from spans import merge


            def test_overlapping():
                assert merge([(1, 3), (2, 6), (8, 10)]) == [(1, 6), (8, 10)]


            def test_empty():
                assert merge([]) == []
        """,
    },
    fix={"spans/merge.py": [("if out and start < out[-1][1]:", "if out and start <= out[-1][1]:")]},
    tests={"tests/test_merge.py": [("", """
        def test_touching():
            assert merge([(1, 2), (2, 4)]) == [(1, 4)]
            assert merge([(5, 7), (1, 5)]) == [(1, 7)]
    """)]},
    fail_to_pass=["tests/test_merge.py::test_touching"],
    pass_to_pass=["tests/test_merge.py::test_overlapping", "tests/test_merge.py::test_empty"],
)

TASKS = [LEAP_YEAR, PASSWORD, GRADES, MERGE_INTERVALS]
