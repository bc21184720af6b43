"""Every test gets its own empty base directory, so no test reads or writes ~/.cache/nanoparcae."""

import pytest


@pytest.fixture(autouse=True)
def private_base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "nanoparcae_base"))
