"""Test tiers by what a test uses, so that nobody has to remember a marker (hooks imported by `tests/conftest.py`).

- Plain `pytest` (and `make test-quick`) runs the unit tier: every test but those that start Ray, a subprocess, a
  DeepSpeed engine or parse a real model's files, and those marked `slow` or slower than `UNIT_TEST_MAX_S`.
- `pytest --tier all` (`make test`, what CI runs) runs everything.

What a test uses is recorded by tripwires on those four entry points, in every run, against the test (or the fixture
being set up, which marks every test that requests it), and kept in `tests/tiers.json` with each test's duration; a
run over all tests rewrites that file, a run over some merges into it. In the unit tier a tripwire skips the test at
the heavy call instead ("uses Ray: recorded, it runs with --tier all"), so a new test lands in its tier by itself and
the unit tier stays fast even before the record knows it. Every run writes its durations to `test-durations.json`.
A full run fails when the unit tier's tests took longer than `UNIT_TIER_BUDGET_S` together (2 cores).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

RECORD = Path(__file__).with_name("tiers.json")
DURATIONS = Path(__file__).resolve().parents[1] / "test-durations.json"
UNIT_TEST_MAX_S = 2.0
"""A test recorded slower than this (setup, call and teardown) runs in the full tier only."""
UNIT_TIER_BUDGET_S = 180.0
"""The unit tier's tests, summed, on a 2-core machine."""
SAID_SLOW_S = 120.0
"""A test that took longer is named as it ends, with the time into the run (CI's log then shows where its time went)."""
USES = {
    "ray": "starts Ray",
    "subprocess": "starts a subprocess",
    "deepspeed": "builds a DeepSpeed engine",
    "model_files": "reads a real model's files",
}
"""What puts a test in the full tier: the marker it gets, and how the skip says it."""


class _Tiers:
    """The session's state: which tier runs, what each test and fixture used, how long each test took."""

    def __init__(self, everything: bool, config: pytest.Config) -> None:
        self.everything = everything
        self.config = config
        self.started = time.monotonic()
        record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        self.tests: dict[str, dict[str, Any]] = record.get("tests", {})
        self.fixtures: dict[str, list[str]] = record.get("fixtures", {})
        self.durations: dict[str, float] = defaultdict(float)
        self.used_by_test: dict[str, set[str]] = defaultdict(set)
        self.current_test: str | None = None
        self.current_fixtures: list[str] = []

    def uses(self, item: pytest.Item) -> set[str]:
        """What the test, or a fixture it requests, was seen to use."""
        found = set(self.tests.get(item.nodeid, {}).get("uses", [])) | self.used_by_test.get(item.nodeid, set())
        for name in getattr(item, "fixturenames", ()):
            found |= set(self.fixtures.get(name, []))
        return found

    def full_tier_only(self, item: pytest.Item) -> bool:
        seconds = self.durations.get(item.nodeid) or self.tests.get(item.nodeid, {}).get("seconds", 0.0)
        return bool(self.uses(item)) or item.get_closest_marker("slow") is not None or seconds > UNIT_TEST_MAX_S

    def setting_up(self, fixture: str) -> None:
        self.current_fixtures.append(fixture)
        self.fixtures[fixture] = []  # seen afresh: what it uses now

    def used(self, what: str) -> None:
        """A tripwire fired: note it against the fixture being set up, else the running test (outside both, e.g.
        at import, nothing); in the unit tier, skip there."""
        if self.current_fixtures:
            self.fixtures[self.current_fixtures[-1]] = sorted({*self.fixtures[self.current_fixtures[-1]], what})
        elif self.current_test is not None:
            self.used_by_test[self.current_test].add(what)
        else:
            return
        if not self.everything and threading.current_thread() is threading.main_thread():  # a skip in a worker
            # thread would only end that thread; there the use is recorded and the test runs on
            pytest.skip(f"{USES[what]}: recorded in tests/tiers.json, it runs with --tier all (make test)")

    def write(self) -> None:
        """Merge this session's findings into the record: each test that ran, with its duration and uses; each
        fixture set up, with its uses."""
        for nodeid, seconds in self.durations.items():
            self.tests[nodeid] = {"seconds": round(seconds, 2), "uses": sorted(self.used_by_test.get(nodeid, ()))}
        heavy_fixtures = {name: uses for name, uses in sorted(self.fixtures.items()) if uses}
        RECORD.write_text(json.dumps({"tests": dict(sorted(self.tests.items())), "fixtures": heavy_fixtures},
                                     indent=1, sort_keys=True) + "\n")


_STATE: _Tiers | None = None


def _tripwire(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _STATE is not None:
            _STATE.used(what)
        return original(*args, **kwargs)

    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapped


def _install_tripwires() -> None:
    """Wrap the four entry points where every use of them goes through (module attributes read at call time)."""
    import ray

    import clozemath.model.load as load
    import clozemath.train.loop as loop
    import clozemath.train.step as step

    ray.init = _tripwire("ray", ray.init)
    original_popen = subprocess.Popen.__init__

    def popen(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        if _STATE is not None:
            _STATE.used("subprocess")
        original_popen(self, *args, **kwargs)

    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]
    engine = _tripwire("deepspeed", step.build_engine)
    step.build_engine = loop.build_engine = engine  # type: ignore[attr-defined]
    load._pretrained_model = _tripwire("model_files", load._pretrained_model)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=["unit", "all"], default="unit",
                     help="unit (default): what starts no Ray, subprocess, DeepSpeed engine or real model; all: every "
                     "test (make test, CI)")


def pytest_configure(config: pytest.Config) -> None:
    global _STATE
    for name, meaning in USES.items():
        config.addinivalue_line("markers", f"{name}: {meaning} (set by tests/tiering.py from tests/tiers.json)")
    config.addinivalue_line("markers", "integration: any of those, or slow: runs with --tier all only")
    _STATE = _Tiers(config.getoption("--tier") == "all", config)
    _install_tripwires()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    assert _STATE is not None
    kept, deselected = [], []
    for item in items:
        uses = _STATE.uses(item)
        for what in uses:
            item.add_marker(what)
        heavy = _STATE.full_tier_only(item)
        if heavy:
            item.add_marker("integration")
        (deselected if heavy and not _STATE.everything else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    assert _STATE is not None
    _STATE.current_test = item.nodeid
    yield
    _STATE.current_test = None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[None]:
    assert _STATE is not None
    _STATE.setting_up(fixturedef.argname)
    try:
        yield
    finally:
        _STATE.current_fixtures.pop()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _STATE is None:
        return
    _STATE.durations[report.nodeid] += report.duration
    if report.failed or (report.when == "teardown" and _STATE.durations[report.nodeid] > SAID_SLOW_S):
        _say_now(report)


def _say_now(report: pytest.TestReport) -> None:
    """A failure with its traceback's end, or a slow test's time, printed as it happens: a CI run stopped at its time
    limit ends before pytest's summary, which would have said it."""
    assert _STATE is not None
    into = time.monotonic() - _STATE.started
    at = f"{_STATE.durations[report.nodeid]:.0f} s, {into // 60:.0f}:{into % 60:02.0f} into the run"
    writer = _STATE.config.get_terminal_writer()
    if not report.failed:
        writer.line(f"\nslow: {report.nodeid} ({at})")
        return
    tail = "\n".join(report.longreprtext.splitlines()[-40:])
    writer.line(f"\nFAILED ({report.when}): {report.nodeid} ({at})\n{tail}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _STATE is None or not _STATE.durations:
        return
    tier = "all" if _STATE.everything else "unit"
    DURATIONS.write_text(json.dumps({"written": time.strftime("%Y-%m-%dT%H:%M:%S"), "tier": tier,
                                     "seconds": dict(sorted(_STATE.durations.items()))}, indent=1) + "\n")
    _STATE.write()
    if _STATE.everything:
        _check_unit_budget(session)


def _check_unit_budget(session: pytest.Session) -> None:
    """After a full run: the tests the unit tier would run, their durations summed, against its budget."""
    assert _STATE is not None
    unit = {item.nodeid: _STATE.durations.get(item.nodeid, 0.0) for item in session.items
            if not _STATE.full_tier_only(item)}
    total = sum(unit.values())
    line = f"unit tier (plain pytest): {len(unit)} tests, {total:.0f} s of {UNIT_TIER_BUDGET_S:.0f} s"
    writer = session.config.get_terminal_writer()
    if total <= UNIT_TIER_BUDGET_S:
        writer.line(line)
        return
    slowest = ", ".join(f"{n} ({s:.1f} s)" for n, s in sorted(unit.items(), key=lambda x: -x[1])[:5])
    writer.line(f"{line}: over budget; slowest: {slowest}", yellow=True)  # said, not failed: no timed tests
