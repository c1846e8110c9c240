"""The missed calls both graph sources keep for the worker's capture thread (capturing.py)."""

import pytest
import torch

from cosyapp.engine.token2wav.capturing import MissedCalls

CPU = torch.device("cpu")


def test_a_key_is_kept_once_and_taken_oldest_first():
    missed: MissedCalls[torch.Tensor] = MissedCalls()
    copies = []

    def copy(value: float):
        def make() -> torch.Tensor:
            copies.append(value)
            return torch.full((2,), value)

        return make

    assert missed.keep("a", copy(1.0), CPU)
    assert not missed.keep("a", copy(2.0), CPU)  # waiting already: no second copy is made
    assert missed.keep("b", copy(3.0), CPU)
    assert copies == [1.0, 3.0] and len(missed) == 2
    with missed.oldest() as taken:
        key, inputs = taken
        assert key == "a" and torch.equal(inputs, torch.full((2,), 1.0))
        assert len(missed) == 2  # counted until its capture has ended
        assert not missed.keep("a", copy(4.0), CPU)
    assert len(missed) == 1
    assert missed.keep("a", copy(5.0), CPU)  # met again after its capture: kept anew
    with missed.oldest() as taken:
        assert taken[0] == "b"


def test_a_failed_capture_leaves_and_its_key_is_kept_no_more():
    missed: MissedCalls[int] = MissedCalls()
    missed.keep("a", lambda: 1, CPU)
    with pytest.raises(RuntimeError), missed.oldest() as taken:
        missed.fail(taken[0])
        raise RuntimeError("capture failed")
    assert len(missed) == 0 and missed.failed == {"a"}
    assert not missed.keep("a", lambda: 2, CPU)
    with missed.oldest() as taken:
        assert taken is None


def test_clear_drops_what_waits_even_during_a_capture():
    missed: MissedCalls[int] = MissedCalls()
    missed.keep("a", lambda: 1, CPU)
    missed.keep("b", lambda: 2, CPU)
    with missed.oldest() as taken:
        assert taken == ("a", 1)
        missed.clear()
        assert len(missed) == 0
    assert len(missed) == 0
