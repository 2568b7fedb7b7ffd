"""``core.wire``'s integer columns: any int64 values round-trip exactly, in the narrowest of int16 / int32 / int64
that holds them (the step records' columns, kept under Ray's inline limit)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_moe.core.wire import pack_ints, unpack_ints


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=30))
def test_int_columns_round_trip_in_the_narrowest_type(values):
    a = np.asarray(values, dtype=np.int64)
    code, raw = pack_ints(a)
    back = unpack_ints((code, raw))
    assert back.dtype == np.int64 and back.flags.writeable and np.array_equal(back, a)
    lo, hi = (min(values), max(values)) if values else (0, 0)
    want = "<i2" if -(1 << 15) <= lo and hi < 1 << 15 else "<i4" if -(1 << 31) <= lo and hi < 1 << 31 else "<i8"
    assert code == want and len(raw) == a.size * int(want[-1])


def test_the_boundaries_of_each_type():
    for values, code in (([32767, -32768], "<i2"), ([32768], "<i4"), ([-32769], "<i4"), ([(1 << 31) - 1], "<i4"),
                         ([1 << 31], "<i8"), ([-(1 << 31) - 1], "<i8")):
        assert pack_ints(np.asarray(values, dtype=np.int64))[0] == code, values
