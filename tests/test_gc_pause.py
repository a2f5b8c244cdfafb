"""megarl.gc_pause: the collector off inside the block, back as it was after (errors included)."""
import gc

import pytest

from megarl.gc_pause import gc_paused

pytestmark = pytest.mark.unit


def test_collector_is_off_inside_and_restored_after_even_on_error():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ImportError), gc_paused():
        assert not gc.isenabled()
        raise ImportError("no such module")
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
