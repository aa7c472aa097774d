"""Shared fixtures (helpers live in helpers.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import FAMILIES  # noqa: E402


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param
