"""Checks on a block pool shared by the tests."""


def invariants_ok(manager) -> bool:
    """True when every invariant of the pool holds (``KVBlockManager.check_invariants`` raises on the first broken)."""
    try:
        manager.check_invariants()
    except AssertionError:
        return False
    return True
