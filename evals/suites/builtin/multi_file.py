"""Built-in tasks whose fix spans several files: each module holds part of the bug."""

from __future__ import annotations

from freetoken_agent.evals.suites.spec import SuiteTask

RECEIPT = SuiteTask(
    name="receipt_total",
    kind="multi-file",
    problem="""
        Receipt totals are wrong

        A receipt for 2 x coffee at $3.50 (`Line("coffee", 350, 2)`) ends with `Total: $35.50` instead of
        `Total: $7.00`. The quantity seems to be ignored, and `format_cents(1234)` gives "$123.34" instead of
        "$12.34".
    """,
    files={
        "shop/__init__.py": "",
        "shop/models.py": '''
            from dataclasses import dataclass


            @dataclass
            class Line:
                name: str
                unit_cents: int
                quantity: int = 1


            def subtotal_cents(lines: list[Line]) -> int:
                """Sum of unit price times quantity over all lines, in cents."""
                return sum(line.unit_cents for line in lines)
        ''',
        "shop/receipt.py": '''
            from shop.models import Line, subtotal_cents


            def format_cents(cents: int) -> str:
                """'$12.34' for 1234 cents."""
                return f"${cents // 10}.{cents % 100:02d}"


            def receipt(lines: list[Line]) -> str:
                """One row per line, then the total."""
                rows = [f"{line.quantity} x {line.name}" for line in lines]
                rows.append(f"Total: {format_cents(subtotal_cents(lines))}")
                return "\\n".join(rows)
        ''',
        "tests/test_receipt.py": """
            from shop.models import Line
            from shop.receipt import format_cents, receipt


            def test_rows():
                assert receipt([Line("tea", 200, 3)]).splitlines()[0] == "3 x tea"


            def test_small_amount():
                assert format_cents(5) == "$0.05"
        """,
    },
    fix={
        "shop/models.py": [("sum(line.unit_cents for line in lines)", "sum(line.unit_cents * line.quantity for line in lines)")],
        "shop/receipt.py": [("{cents // 10}", "{cents // 100}")],
    },
    tests={"tests/test_receipt.py": [("", """
        def test_total():
            assert receipt([Line("coffee", 350, 2)]).endswith("Total: $7.00")


        def test_format_cents():
            assert format_cents(1234) == "$12.34"
    """)]},
    fail_to_pass=["tests/test_receipt.py::test_total", "tests/test_receipt.py::test_format_cents"],
    pass_to_pass=["tests/test_receipt.py::test_rows", "tests/test_receipt.py::test_small_amount"],
)

SETTINGS = SuiteTask(
    name="settings_keys_and_spaces",
    kind="multi-file",
    problem="""
        Settings written as `PORT = 9000` are ignored

        `load("PORT = 9000")["port"]` is still "8080": the loaded dict has a key "PORT " with value " 9000".
        Keys should be case-insensitive and spaces around keys and values ignored. Also
        `get_bool(load("DEBUG=True"), "debug")` returns False; boolean values should be case-insensitive.
    """,
    files={
        "settings/__init__.py": "",
        "settings/loader.py": '''
            def parse(text: str) -> dict[str, str]:
                """Parse 'KEY = value' lines; blank lines and lines starting with '#' are ignored."""
                out: dict[str, str] = {}
                for line in text.splitlines():
                    if not line.strip() or line.startswith("#"):
                        continue
                    key, _, value = line.partition("=")
                    out[key] = value
                return out
        ''',
        "settings/access.py": '''
            from settings.loader import parse

            DEFAULTS = {"port": "8080", "debug": "false"}


            def load(text: str) -> dict[str, str]:
                """Settings from text over the defaults; keys are case-insensitive."""
                merged = dict(DEFAULTS)
                merged.update(parse(text))
                return merged


            def get_bool(settings: dict[str, str], key: str) -> bool:
                return settings[key] in ("true", "1", "yes")
        ''',
        "tests/test_settings.py": """
            from settings.access import DEFAULTS, get_bool, load


            def test_defaults():
                assert load("# nothing here\\n") == DEFAULTS


            def test_plain():
                assert load("port=1")["port"] == "1"
                assert get_bool({"debug": "yes"}, "debug")
        """,
    },
    fix={
        "settings/loader.py": [("out[key] = value", "out[key.strip()] = value.strip()")],
        "settings/access.py": [("merged.update(parse(text))", "merged.update({k.lower(): v for k, v in parse(text).items()})"),
                               ("settings[key] in", "settings[key].lower() in")],
    },
    tests={"tests/test_settings.py": [("", """
        def test_spaces_and_case():
            assert load("PORT = 9000")["port"] == "9000"
            assert get_bool(load("DEBUG=True"), "debug")
    """)]},
    fail_to_pass=["tests/test_settings.py::test_spaces_and_case"],
    pass_to_pass=["tests/test_settings.py::test_defaults", "tests/test_settings.py::test_plain"],
)

UNITS = SuiteTask(
    name="unit_conversion",
    kind="multi-file",
    problem="""
        convert() inverts conversions and rejects kilometres

        `convert(1, "ft", "in")` returns 0.083 instead of 12. Also `convert(2.5, "km", "m")` raises
        `ValueError: unknown unit 'km'`; it should give 2500.
    """,
    files={
        "units/__init__.py": "",
        "units/table.py": """
            # metres per unit
            FACTORS = {"m": 1.0, "cm": 0.01, "mm": 0.001, "in": 0.0254, "ft": 0.3048}
        """,
        "units/convert.py": '''
            from units.table import FACTORS


            def convert(value: float, src: str, dst: str) -> float:
                """value in unit src, expressed in unit dst."""
                for unit in (src, dst):
                    if unit not in FACTORS:
                        raise ValueError(f"unknown unit {unit!r}")
                return value * FACTORS[dst] / FACTORS[src]
        ''',
        "tests/test_convert.py": """
            import pytest

            from units.convert import convert


            def test_identity():
                assert convert(5, "m", "m") == 5


            def test_unknown():
                with pytest.raises(ValueError):
                    convert(1, "parsec", "m")
        """,
    },
    fix={
        "units/table.py": [('"ft": 0.3048}', '"ft": 0.3048, "km": 1000.0}')],
        "units/convert.py": [("value * FACTORS[dst] / FACTORS[src]", "value * FACTORS[src] / FACTORS[dst]")],
    },
    tests={"tests/test_convert.py": [("", """
        def test_direction():
            assert convert(1, "ft", "in") == pytest.approx(12)


        def test_kilometres():
            assert convert(2.5, "km", "m") == pytest.approx(2500)
    """)]},
    fail_to_pass=["tests/test_convert.py::test_direction", "tests/test_convert.py::test_kilometres"],
    pass_to_pass=["tests/test_convert.py::test_identity", "tests/test_convert.py::test_unknown"],
)

SUMMARY = SuiteTask(
    name="summary_median_count",
    kind="multi-file",
    problem="""
        summarize() reports the wrong count and median

        `summarize([1, 1, 2, 4])` reports count 3 and median 2; expected count 4 and median 1.5 (the mean of
        the two middle values). `median([4, 1, 3, 2])` should be 2.5.
    """,
    files={
        "numstats/__init__.py": "",
        "numstats/stats.py": '''
            def mean(xs: list[float]) -> float:
                return sum(xs) / len(xs)


            def median(xs: list[float]) -> float:
                """Middle value; the mean of the two middle values for an even count."""
                s = sorted(xs)
                return s[len(s) // 2]
        ''',
        "numstats/summary.py": '''
            from numstats.stats import mean, median


            def summarize(xs: list[float]) -> dict[str, float]:
                """count, min, max, mean and median of a non-empty list."""
                if not xs:
                    raise ValueError("no data")
                return {"count": len(set(xs)), "min": min(xs), "max": max(xs), "mean": mean(xs), "median": median(xs)}
        ''',
        "tests/test_summary.py": """
            import pytest

            from numstats.summary import summarize


            def test_odd():
                assert summarize([3, 1, 2]) == {"count": 3, "min": 1, "max": 3, "mean": 2.0, "median": 2}


            def test_empty():
                with pytest.raises(ValueError):
                    summarize([])
        """,
    },
    fix={
        "numstats/stats.py": [("    return s[len(s) // 2]\n",
                               "    mid = len(s) // 2\n    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2\n")],
        "numstats/summary.py": [('"count": len(set(xs))', '"count": len(xs)')],
    },
    tests={"tests/test_issue.py": """
        from numstats.stats import median
        from numstats.summary import summarize


        def test_even_count():
            result = summarize([1, 1, 2, 4])
            assert result["count"] == 4
            assert result["median"] == 1.5


        def test_median_even():
            assert median([4, 1, 3, 2]) == 2.5
    """},
    fail_to_pass=["tests/test_issue.py::test_even_count", "tests/test_issue.py::test_median_even"],
    pass_to_pass=["tests/test_summary.py::test_odd", "tests/test_summary.py::test_empty"],
)

EVENT_BUS = SuiteTask(
    name="event_bus_subscribers",
    kind="multi-file",
    problem="""
        Event bus: second subscriber replaces the first, and wildcards match too much

        After `bus.subscribe("orders.new", a)` and `bus.subscribe("orders.new", b)`, publishing calls only
        `b`; both should be called. And a subscription to "orders.*" receives "archived.orders.new"; a
        pattern ending in "*" should only match topics that start with the part before the "*".
    """,
    files={
        "bus/__init__.py": "from bus.core import Bus\n",
        "bus/wildcard.py": '''
            def matches(pattern: str, topic: str) -> bool:
                """'a.b' matches only 'a.b'; 'a.*' matches any topic that starts with 'a.'."""
                if pattern.endswith("*"):
                    return pattern[:-1] in topic
                return pattern == topic
        ''',
        "bus/core.py": '''
            from collections.abc import Callable

            from bus.wildcard import matches


            class Bus:
                """Publish/subscribe by topic; a subscription pattern may end in '*' to match a prefix."""

                def __init__(self) -> None:
                    self.handlers: dict[str, list[Callable[[object], None]]] = {}

                def subscribe(self, pattern: str, handler: Callable[[object], None]) -> None:
                    self.handlers[pattern] = [handler]

                def publish(self, topic: str, payload: object) -> int:
                    """Call every handler whose pattern matches topic; return how many were called."""
                    called = 0
                    for pattern, handlers in self.handlers.items():
                        if matches(pattern, topic):
                            for handler in handlers:
                                handler(payload)
                                called += 1
                    return called
        ''',
        "tests/test_bus.py": """
            from bus import Bus
            from bus.wildcard import matches


            def test_single_subscriber():
                got = []
                bus = Bus()
                bus.subscribe("orders.new", got.append)
                assert bus.publish("orders.new", 1) == 1
                assert got == [1]


            def test_exact_match():
                assert matches("orders.new", "orders.new")
                assert not matches("orders.new", "orders.old")
        """,
    },
    fix={
        "bus/core.py": [("self.handlers[pattern] = [handler]", "self.handlers.setdefault(pattern, []).append(handler)")],
        "bus/wildcard.py": [("return pattern[:-1] in topic", "return topic.startswith(pattern[:-1])")],
    },
    tests={"tests/test_bus.py": [("", """
        def test_two_subscribers():
            got = []
            bus = Bus()
            bus.subscribe("orders.new", got.append)
            bus.subscribe("orders.new", lambda p: got.append(p * 10))
            assert bus.publish("orders.new", 2) == 2
            assert got == [2, 20]


        def test_wildcard_is_a_prefix():
            assert matches("orders.*", "orders.new")
            assert not matches("orders.*", "archived.orders.new")
    """)]},
    fail_to_pass=["tests/test_bus.py::test_two_subscribers", "tests/test_bus.py::test_wildcard_is_a_prefix"],
    pass_to_pass=["tests/test_bus.py::test_single_subscriber", "tests/test_bus.py::test_exact_match"],
)

TASKS = [RECEIPT, SETTINGS, UNITS, SUMMARY, EVENT_BUS]
