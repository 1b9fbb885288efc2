"""Built-in tasks whose bug is an off-by-one: a range end, a loop bound, an inclusive interval."""

from __future__ import annotations

from freetoken_agent.evals.suites.spec import SuiteTask

PAGINATE = SuiteTask(
    name="paginate_last_page",
    kind="off-by-one",
    problem="""
        `paginate` drops the last page when the items do not fill it

        `paginate([1, 2, 3, 4, 5], 2)` returns `[[1, 2], [3, 4]]`; the item 5 is lost. The docstring promises
        that the last page may be shorter. `page_count(5, 2)` also says 2 where 3 pages are needed.
    """,
    files={
        "pager/__init__.py": "from pager.core import page_count, paginate\n",
        "pager/core.py": '''
            """Split a sequence into pages."""


            def page_count(n_items: int, size: int) -> int:
                """Number of pages needed for n_items items, size per page."""
                if size <= 0:
                    raise ValueError("size must be positive")
                return n_items // size


            def paginate(items: list, size: int) -> list[list]:
                """The items split into pages of `size` (the last page may be shorter)."""
                return [items[i * size:(i + 1) * size] for i in range(page_count(len(items), size))]
        ''',
        "tests/test_core.py": """
            import pytest

            from pager import page_count, paginate


            def test_exact_pages():
                assert paginate([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


            def test_bad_size():
                with pytest.raises(ValueError):
                    page_count(3, 0)
        """,
    },
    fix={"pager/core.py": [("return n_items // size", "return (n_items + size - 1) // size")]},
    tests={"tests/test_core.py": [("", """


        def test_partial_last_page():
            assert paginate([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
            assert page_count(5, 2) == 3
    """)]},
    fail_to_pass=["tests/test_core.py::test_partial_last_page"],
    pass_to_pass=["tests/test_core.py::test_exact_pages", "tests/test_core.py::test_bad_size"],
)

MOVING_AVERAGE = SuiteTask(
    name="moving_average_last_window",
    kind="off-by-one",
    problem="""
        moving_average misses the final window

        `moving_average([1, 2, 3, 4], 2)` gives `[1.5, 2.5]` but should give `[1.5, 2.5, 3.5]`, and
        `moving_average([2, 4], 2)` gives `[]` instead of `[3.0]`.
    """,
    files={
        "series/__init__.py": "",
        "series/window.py": '''
            def moving_average(xs: list[float], window: int) -> list[float]:
                """Averages of every run of `window` consecutive values, in order."""
                if window <= 0 or window > len(xs):
                    return []
                return [sum(xs[i:i + window]) / window for i in range(len(xs) - window)]
        ''',
        "tests/test_window.py": """
            from series.window import moving_average


            def test_bad_window_is_empty():
                assert moving_average([1, 2, 3], 0) == []
                assert moving_average([1, 2], 3) == []
        """,
    },
    fix={"series/window.py": [("range(len(xs) - window)", "range(len(xs) - window + 1)")]},
    tests={"tests/test_issue.py": """
        from series.window import moving_average


        def test_all_windows():
            assert moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]


        def test_window_as_long_as_data():
            assert moving_average([2, 4], 2) == [3.0]
    """},
    fail_to_pass=["tests/test_issue.py::test_all_windows", "tests/test_issue.py::test_window_as_long_as_data"],
    pass_to_pass=["tests/test_window.py::test_bad_window_is_empty"],
)

BINARY_SEARCH = SuiteTask(
    name="binary_search_bounds",
    kind="off-by-one",
    problem="""
        find() cannot find the first or last element

        `find([1, 2, 3], 3)` returns -1, as does `find([7], 7)`. Elements in the middle are found.
    """,
    files={
        "search/__init__.py": "from search.bisect_find import find\n",
        "search/bisect_find.py": '''
            def find(xs: list[int], target: int) -> int:
                """Index of target in the sorted list xs, or -1 when absent."""
                lo, hi = 0, len(xs) - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    if xs[mid] == target:
                        return mid
                    if xs[mid] < target:
                        lo = mid + 1
                    else:
                        hi = mid - 1
                return -1
        ''',
        "tests/test_find.py": """
            from search import find


            def test_middle():
                assert find([1, 2, 3], 2) == 1


            def test_absent():
                assert find([1, 3, 5], 4) == -1
                assert find([], 4) == -1
        """,
    },
    fix={"search/bisect_find.py": [("while lo < hi:", "while lo <= hi:")]},
    tests={"tests/test_find.py": [("", """


        def test_ends():
            assert find([1, 2, 3], 1) == 0
            assert find([1, 2, 3], 3) == 2
            assert find([7], 7) == 0
    """)]},
    fail_to_pass=["tests/test_find.py::test_ends"],
    pass_to_pass=["tests/test_find.py::test_middle", "tests/test_find.py::test_absent"],
)

DAYS_BETWEEN = SuiteTask(
    name="days_between_inclusive",
    kind="off-by-one",
    problem="""
        days_between leaves out the end date

        The docstring says both ends are included, but `days_between(date(2024, 2, 28), date(2024, 3, 1))`
        returns only Feb 28 and Feb 29, and `days_between(d, d)` is empty instead of `[d]`.
    """,
    files={
        "calendar_utils/__init__.py": "",
        "calendar_utils/span.py": '''
            from datetime import date, timedelta


            def days_between(start: date, end: date) -> list[date]:
                """Every date from start to end, both included (empty when end is before start)."""
                return [start + timedelta(days=i) for i in range((end - start).days)]
        ''',
        "tests/test_span.py": """
            from datetime import date

            from calendar_utils.span import days_between


            def test_reversed_is_empty():
                assert days_between(date(2024, 1, 5), date(2024, 1, 1)) == []
        """,
    },
    fix={"calendar_utils/span.py": [("range((end - start).days)", "range((end - start).days + 1)")]},
    tests={"tests/test_span.py": [("", """


        def test_includes_end():
            assert days_between(date(2024, 2, 28), date(2024, 3, 1)) == [
                date(2024, 2, 28), date(2024, 2, 29), date(2024, 3, 1)]


        def test_single_day():
            assert days_between(date(2024, 5, 5), date(2024, 5, 5)) == [date(2024, 5, 5)]
    """)]},
    fail_to_pass=["tests/test_span.py::test_includes_end", "tests/test_span.py::test_single_day"],
    pass_to_pass=["tests/test_span.py::test_reversed_is_empty"],
)

TASKS = [PAGINATE, MOVING_AVERAGE, BINARY_SEARCH, DAYS_BETWEEN]
