import pytest

from inference_api.engine.rows import RowTable


def test_allocates_lowest_free_row_and_reuses_freed_rows():
    table = RowTable(3)
    assert [table.allocate() for _ in range(3)] == [0, 1, 2]
    assert table.allocate() is None and table.num_free == 0
    table.free(1)
    assert table.num_used == 2
    assert table.allocate() == 1


def test_double_free_and_unknown_rows_are_errors():
    table = RowTable(2)
    row = table.allocate()
    table.free(row)
    with pytest.raises(ValueError):
        table.free(row)
    with pytest.raises(ValueError):
        table.free(5)
