"""The transfer's wire (service/wire/weight_transfer.py): the bytes an update carries, read from its update info."""

from __future__ import annotations

import pytest

from das.service.wire.weight_transfer import update_bytes


def test_bytes_are_elements_times_dtype_size_over_every_tensor():
    info = {"names": ["w", "b", "s"], "dtype_names": ["float32", "bfloat16", "float64"], "shapes": [[3, 4], [5], []]}
    assert update_bytes(info) == 12 * 4 + 5 * 2 + 1 * 8
    assert update_bytes([info, info]) == update_bytes(info)  # per rank: each receives the same broadcast


@pytest.mark.parametrize("info, says", [({"names": ["w"], "dtype_names": ["int4"], "shapes": [[2]]}, "int4"),
                                        ("not an object", "an object")])
def test_a_dtype_it_cannot_size_or_a_malformed_info_is_refused(info, says):
    with pytest.raises(ValueError, match=says):
        update_bytes(info)
