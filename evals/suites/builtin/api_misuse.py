"""Built-in tasks whose bug is a misused API: in-place sort, mutable defaults, re.match, rstrip, strptime, split."""

from __future__ import annotations

from freetoken_agent.evals.suites.spec import SuiteTask

SORTED_NAMES = SuiteTask(
    name="sorted_names_returns_none",
    kind="wrong-api",
    problem="""
        sorted_names returns None and reorders the caller's list

        `sorted_names(["bob", "Alice", "carol"])` returns None (and sorts the argument in place). It should
        return a new list `["Alice", "bob", "carol"]` and leave the input unchanged.
    """,
    files={
        "people/__init__.py": "",
        "people/directory.py": '''
            def sorted_names(names: list[str]) -> list[str]:
                """Names in case-insensitive alphabetical order; the input list is left unchanged."""
                return names.sort(key=str.lower)


            def initials(name: str) -> str:
                """'Ada Lovelace' -> 'AL'."""
                return "".join(part[0].upper() for part in name.split())
        ''',
        "tests/test_directory.py": """
            from people.directory import initials, sorted_names


            def test_initials():
                assert initials("Ada Lovelace") == "AL"
        """,
    },
    fix={"people/directory.py": [("return names.sort(key=str.lower)", "return sorted(names, key=str.lower)")]},
    tests={"tests/test_directory.py": [("", """
        def test_sorted_copy():
            names = ["bob", "Alice", "carol"]
            assert sorted_names(names) == ["Alice", "bob", "carol"]
            assert names == ["bob", "Alice", "carol"]
    """)]},
    fail_to_pass=["tests/test_directory.py::test_sorted_copy"],
    pass_to_pass=["tests/test_directory.py::test_initials"],
)

MUTABLE_DEFAULT = SuiteTask(
    name="mutable_default_tags",
    kind="wrong-api",
    problem="""
        add_tag without a list remembers tags from earlier calls

        `add_tag("a")` returns `["a"]`, but a following `add_tag("b")` returns `["a", "b"]` instead of
        `["b"]`. Each call without a list should start from a new, empty list.
    """,
    files={
        "tags/__init__.py": "",
        "tags/tagging.py": '''
            def add_tag(tag: str, tags: list[str] = []) -> list[str]:
                """`tags` with `tag` appended (a new list when no list is given)."""
                tags.append(tag)
                return tags
        ''',
        "tests/test_tagging.py": """
            from tags.tagging import add_tag


            def test_given_list():
                assert add_tag("x", ["a"]) == ["a", "x"]
        """,
    },
    fix={"tags/tagging.py": [("tags: list[str] = []) -> list[str]:", "tags: list[str] | None = None) -> list[str]:"),
                             ("    tags.append(tag)\n", "    if tags is None:\n        tags = []\n    tags.append(tag)\n")]},
    tests={"tests/test_tagging.py": [("", """
        def test_fresh_list_per_call():
            assert add_tag("a") == ["a"]
            assert add_tag("b") == ["b"]
    """)]},
    fail_to_pass=["tests/test_tagging.py::test_fresh_list_per_call"],
    pass_to_pass=["tests/test_tagging.py::test_given_list"],
)

FIRST_EMAIL = SuiteTask(
    name="first_email_anywhere",
    kind="wrong-api",
    problem="""
        first_email only finds an address at the very start of the text

        `first_email("Contact: ann@example.org, thanks")` returns None; it should return "ann@example.org".
    """,
    files={
        "mail/__init__.py": "",
        "mail/extract.py": '''
            import re

            EMAIL = re.compile(r"[\\w.+-]+@[\\w-]+\\.[\\w.]+")


            def first_email(text: str) -> str | None:
                """The first e-mail address anywhere in text, or None."""
                m = EMAIL.match(text)
                return m.group(0) if m else None
        ''',
        "tests/test_extract.py": """
            from mail.extract import first_email


            def test_at_start():
                assert first_email("bob@example.com is here") == "bob@example.com"


            def test_none():
                assert first_email("no address") is None
        """,
    },
    fix={"mail/extract.py": [("EMAIL.match(text)", "EMAIL.search(text)")]},
    tests={"tests/test_extract.py": [("", """
        def test_in_the_middle():
            assert first_email("Contact: ann@example.org, thanks") == "ann@example.org"
    """)]},
    fail_to_pass=["tests/test_extract.py::test_in_the_middle"],
    pass_to_pass=["tests/test_extract.py::test_at_start", "tests/test_extract.py::test_none"],
)

STEM = SuiteTask(
    name="stem_rstrip_suffix",
    kind="wrong-api",
    problem="""
        stem() eats letters of the file name

        `stem("report.txt")` returns "repor" and `stem("text.txt")` returns "". Only the exact suffix should
        be removed: "report" and "text".
    """,
    files={
        "paths/__init__.py": "",
        "paths/names.py": '''
            def stem(filename: str, suffix: str = ".txt") -> str:
                """filename without the given suffix (unchanged when it does not end with it)."""
                return filename.rstrip(suffix)
        ''',
        "tests/test_names.py": """
            from paths.names import stem


            def test_other_suffix_untouched():
                assert stem("a.md") == "a.md"


            def test_simple():
                assert stem("notes.txt") == "notes"
        """,
    },
    fix={"paths/names.py": [("filename.rstrip(suffix)", "filename.removesuffix(suffix)")]},
    tests={"tests/test_issue.py": """
        from paths.names import stem


        def test_keeps_letters_of_the_stem():
            assert stem("report.txt") == "report"
            assert stem("text.txt") == "text"
    """},
    fail_to_pass=["tests/test_issue.py::test_keeps_letters_of_the_stem"],
    pass_to_pass=["tests/test_names.py::test_other_suffix_untouched", "tests/test_names.py::test_simple"],
)

CLOCK = SuiteTask(
    name="parse_clock_minutes",
    kind="wrong-api",
    problem="""
        parse_clock gets the minutes wrong

        `parse_clock("09:05")` returns `time(9, 0)` and `parse_clock("23:59")` raises ValueError. Expected
        `time(9, 5)` and `time(23, 59)`.
    """,
    files={
        "clock/__init__.py": "",
        "clock/parse.py": '''
            from datetime import datetime, time


            def parse_clock(text: str) -> time:
                """Parse a 24-hour clock time such as '09:05' or '23:59'."""
                return datetime.strptime(text, "%H:%m").time()


            def minutes_since_midnight(t: time) -> int:
                return t.hour * 60 + t.minute
        ''',
        "tests/test_parse.py": """
            from datetime import time

            import pytest

            from clock.parse import minutes_since_midnight, parse_clock


            def test_invalid_hour():
                with pytest.raises(ValueError):
                    parse_clock("25:00")


            def test_minutes_since_midnight():
                assert minutes_since_midnight(time(1, 30)) == 90
        """,
    },
    fix={"clock/parse.py": [('"%H:%m"', '"%H:%M"')]},
    tests={"tests/test_parse.py": [("", """
        def test_minutes_are_read():
            assert parse_clock("09:05") == time(9, 5)
            assert parse_clock("23:59") == time(23, 59)
    """)]},
    fail_to_pass=["tests/test_parse.py::test_minutes_are_read"],
    pass_to_pass=["tests/test_parse.py::test_invalid_hour", "tests/test_parse.py::test_minutes_since_midnight"],
)

HEADER = SuiteTask(
    name="header_value_with_colon",
    kind="wrong-api",
    problem="""
        parse_header fails when the value contains a colon

        `parse_header("Host: localhost:8000")` raises `ValueError: too many values to unpack`. It should
        return `("host", "localhost:8000")`.
    """,
    files={
        "headers/__init__.py": "",
        "headers/parse.py": '''
            def parse_header(line: str) -> tuple[str, str]:
                """Split 'Name: value' into (lower-cased name, value without surrounding spaces)."""
                name, value = line.split(":")
                return name.strip().lower(), value.strip()
        ''',
        "tests/test_parse.py": """
            from headers.parse import parse_header


            def test_simple():
                assert parse_header("Content-Type: text/html") == ("content-type", "text/html")
        """,
    },
    fix={"headers/parse.py": [('line.split(":")', 'line.split(":", 1)')]},
    tests={"tests/test_parse.py": [("", """
        def test_colon_in_value():
            assert parse_header("Host: localhost:8000") == ("host", "localhost:8000")
    """)]},
    fail_to_pass=["tests/test_parse.py::test_colon_in_value"],
    pass_to_pass=["tests/test_parse.py::test_simple"],
)

TASKS = [SORTED_NAMES, MUTABLE_DEFAULT, FIRST_EMAIL, STEM, CLOCK, HEADER]
