from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The packs bundled with the repository (see fixtures/README.md)."""
    return FIXTURES
