"""The upkeep row's lease: one holder at a time, and not again before its interval."""

from datetime import timedelta

import pytest

from django_taskguard.ledger import upkeep as store

pytestmark = pytest.mark.django_db(transaction=True)


def test_upkeep_lease__one_holder_then_none_until_the_interval_passes():
    hold, every = timedelta(seconds=30), timedelta(seconds=60)
    assert store.latest() is None
    assert store.take("a", hold, every)
    assert not store.take("b", hold, every)  # held
    assert store.finish("a", {"missed_slots": 2})
    assert not store.take("b", hold, every)  # free, but it ran less than a minute ago
    assert store.take("b", hold, timedelta(0))
    assert not store.finish("a", {})  # a's lease is gone: b holds it
    row = store.latest()
    assert row is not None and row.holder == "b" and row.result == {"missed_slots": 2}
