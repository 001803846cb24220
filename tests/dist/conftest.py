import pytest


# Every multi-process test has a hard timeout so a hang fails instead of stalling CI;
# shardwise.launch also stops all workers as soon as one fails.
def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/dist/" in str(item.fspath):
            item.add_marker(pytest.mark.dist)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(180))
