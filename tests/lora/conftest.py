"""The Engine fixtures' strict leak check, for the LoRA tests' engine too."""

from tests.engine.conftest import strict_env  # noqa: F401
