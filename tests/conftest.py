"""Turns hardware markers (`gpu`, `trt`) into skips that say why they cannot run here."""

import pytest

from stack.testing import MARKER_SKIP_REASONS


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, reason_for in MARKER_SKIP_REASONS.items():
            if marker in item.keywords:
                reason = reason_for()
                if reason:
                    item.add_marker(pytest.mark.skip(reason=reason))
