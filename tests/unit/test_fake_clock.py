import pytest

from tests.support.clock import FakeClock


def test_reads_what_it_was_set_to_and_advances() -> None:
    clock = FakeClock(5.0)
    assert clock() == 5.0
    assert clock.advance(2.5) == 7.5
    clock.now = 100.0
    assert clock() == 100.0


def test_refuses_to_go_back() -> None:
    clock = FakeClock()
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1.0)
    assert clock() == 0.0
