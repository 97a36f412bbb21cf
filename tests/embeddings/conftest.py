"""Embedding tests run their children with the strict leak check, as the Engine tests do."""

from tests.engine.conftest import strict_env  # noqa: F401 - a fixture
