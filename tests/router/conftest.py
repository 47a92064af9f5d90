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
            # installed without a C compiler (setup.py then leaves the module out); CI builds it and
            # tests/helm/test_dockerfile.py fails there if it did not
            pytest.skip("router/_owner_map.c not built (no C compiler at install): the python case runs")
    else:
        monkeypatch.setattr(kv_owners, "OwnerMap", None)
    return request.param
