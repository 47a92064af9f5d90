"""Fixtures the router tests share."""
from __future__ import annotations

import pytest

import router.kv_owners as kv_owners


@pytest.fixture(params=["native", "python"])
def owner_map(request, monkeypatch) -> str:
    """Run the test once per owner-table implementation, → its name: "native"
    (router/_owner_map.c; skipped where it did not build) and "python" (`kv_owners.OwnerMap`
    patched away, so tables built in the test hold a dict and run the Python recipes)."""
    if request.param == "native":
        if not kv_owners.NATIVE:
            pytest.skip("router/_owner_map.c did not build")
    else:
        monkeypatch.setattr(kv_owners, "OwnerMap", None)
    return request.param
