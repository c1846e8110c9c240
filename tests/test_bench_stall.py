"""bench/stall.py: every thread's stack goes to the file given once the set time passes without
progress, and not while progress keeps coming."""

import time

from cosyapp.bench.stall import progress, stall_dumps


def test_a_stall_dumps_every_threads_stack(tmp_path):
    out = tmp_path / "stall.txt"
    with out.open("w") as file, stall_dumps(0.2, file):
        time.sleep(0.6)  # no progress: at least one dump
    dumped = out.read_text()
    assert "most recent call first" in dumped and "test_a_stall_dumps_every_threads_stack" in dumped


def test_progress_holds_the_dump_off_and_zero_seconds_turns_it_off(tmp_path):
    out = tmp_path / "stall.txt"
    with out.open("w") as file:
        with stall_dumps(0.4, file):
            for _ in range(8):
                time.sleep(0.1)
                progress()
        with stall_dumps(0, file):
            time.sleep(0.3)
            progress()  # outside an active dump: nothing armed
        time.sleep(0.5)  # and nothing left armed after either
    assert out.read_text() == ""
