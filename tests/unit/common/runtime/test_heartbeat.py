"""Heartbeats: the file's age is what `up`'s stall watchdog reads; the callable form beats at most once per interval
(a warm start calls it every step) and `now()` always."""

import os
import time

from grpo_stream.common.runtime.heartbeat import Heartbeat, beat, beat_path, seconds_since_beat


def test_a_beat_resets_the_age_and_no_beat_reads_as_none(tmp_path):
    assert seconds_since_beat(tmp_path, "trainer-0") is None
    beat(tmp_path, "trainer-0")
    os.utime(beat_path(tmp_path, "trainer-0"), (time.time() - 100, time.time() - 100))
    assert 99 <= seconds_since_beat(tmp_path, "trainer-0") <= 101
    beat(tmp_path, "trainer-0")
    assert seconds_since_beat(tmp_path, "trainer-0") < 5


def test_the_callable_beats_at_most_once_per_interval_and_now_always(tmp_path):
    heartbeat = Heartbeat(tmp_path, "trainer-1", every_s=3600)
    heartbeat()
    old = time.time() - 50
    os.utime(beat_path(tmp_path, "trainer-1"), (old, old))
    heartbeat()  # within the interval: the file keeps its age
    assert seconds_since_beat(tmp_path, "trainer-1") >= 49
    heartbeat.now()
    assert seconds_since_beat(tmp_path, "trainer-1") < 5


def test_a_beat_without_a_run_directory_or_a_writable_one_never_raises(tmp_path):
    beat(None, "trainer-0")
    blocked = tmp_path / "file"
    blocked.write_text("")
    beat(blocked, "trainer-0")  # RUN_DIR is a file: nothing written, nothing raised


def test_a_symlink_planted_at_a_beat_path_is_not_followed(tmp_path):
    """beat() touched whatever a link at RUN_DIR/heartbeats/NAME named (set its mtime, or created it when missing)."""
    victim, missing = tmp_path / "victim", tmp_path / "created-elsewhere"
    victim.write_text("x")
    os.utime(victim, (1000, 1000))
    beat_path(tmp_path, "trainer-0").parent.mkdir()
    beat_path(tmp_path, "trainer-0").symlink_to(victim)
    beat_path(tmp_path, "trainer-1").symlink_to(missing)
    beat(tmp_path, "trainer-0")
    beat(tmp_path, "trainer-1")
    assert victim.stat().st_mtime == 1000 and not missing.exists()
