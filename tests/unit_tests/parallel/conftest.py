"""The ``ranks4`` tests (4 spawned gloo ranks) run only when asked for.

Four CPU processes next to pytest-xdist's workers would overload the 2-core CI machines, so
tests marked ``ranks4`` are deselected unless the ``-m`` expression names the marker
(``-m ranks4``) or the test is named by its full node id.
"""

from __future__ import annotations

MARKER = "ranks4"


def pytest_collection_modifyitems(config, items):
    if MARKER in (config.getoption("markexpr") or ""):
        return  # -m decides (e.g. `-m ranks4` selects them, `-m "not ranks4"` drops them)
    named = {arg for arg in config.args if "::" in arg}
    keep, dropped = [], []
    for item in items:
        wanted = item.get_closest_marker(MARKER) is None or item.nodeid in named
        (keep if wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
