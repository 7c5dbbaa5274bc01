"""A tenant whose key grants no pins (max_pins = 0, the default) is refused PinPrefix with
PERMISSION_DENIED (HTTP 403): a right not granted, not a budget to free by unpinning."""

from __future__ import annotations

import grpc
import pytest

from tenancy.door import TenantDoor, TenantRefused
from tenancy.gate import Caller
from tenancy.keys import Tenant

CHAIN = [b"block-0", b"block-1"]


def test_no_pins_granted_is_permission_denied():
    door = TenantDoor()
    caller = Caller("bob", Tenant("bob", max_pins=0), via="key")
    with pytest.raises(TenantRefused) as refused:
        door.reserve_pin(caller, CHAIN, ttl_s=60.0)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "max_pins is 0" in refused.value.message
    assert "unpin" not in refused.value.message


def test_a_spent_pin_budget_is_still_resource_exhausted():
    door = TenantDoor()
    caller = Caller("pinner", Tenant("pinner", max_pins=1), via="key")
    with pytest.raises(TenantRefused) as refused:
        door.reserve_pin(caller, CHAIN, ttl_s=60.0)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "unpin some first" in refused.value.message
