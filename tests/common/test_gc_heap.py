"""A service's start-up heap frozen out of the garbage collector's full collections
(`services.common.gc_heap`)."""

import gc
import weakref

from services.common.gc_heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_start_up_garbage_is_collected_and_what_lives_on_is_frozen():
    garbage, kept = _Node(), _Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_heap("test")
        assert gone() is None  # collected before the freeze, not kept forever
        assert frozen == gc.get_freeze_count() > 0
        assert gc.is_tracked(kept) and not any(o is kept for o in gc.get_objects())  # out of every collection
        later = _Node()
        assert any(o is later for o in gc.get_objects())  # what comes after is collected as before
    finally:
        gc.unfreeze()
