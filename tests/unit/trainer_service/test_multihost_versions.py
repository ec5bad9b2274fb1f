"""Trainer processes of different grpo-stream versions (an image updated on some hosts only): refused at start in
every process, naming the version, not blamed on the config; a message one cannot read names the version too. The
store is a dict and the collective a stand-in (logic only); the real two-process job: tests/e2e."""

import hashlib
import hmac
import json

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service import multihost
from grpo_stream.trainer_service.checkpoints.errors import RunRefused
from grpo_stream.trainer_service.control_messages import ControlCodec, ControlMessageError, Step
from grpo_stream.trainer_service.multihost import TrainerGroup
from tests.unit.trainer_service.test_multihost import Store

CODEC = ControlCodec(b"k" * 64, b"\x07" * 16)


def verdicts(monkeypatch, follower_protocol: str, overrides=()):
    """Both processes' check_same_config errors, the follower's grpo-stream protocol being `follower_protocol`."""
    from jax.experimental import multihost_utils

    cfg = load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=4"])
    store, rows, errors = Store(), [], []
    leader, follower = TrainerGroup(2, 0, store, CODEC), TrainerGroup(2, 1, store, CODEC)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda mine: rows.append(np.asarray(mine)) or mine)
    theirs = load_config(None, ["trainer.processes=2", "trainer.mesh.fsdp=4", *overrides])
    processes = ((leader, multihost.protocol(), cfg), (follower, follower_protocol, theirs))
    for group, proto, c in processes:
        monkeypatch.setattr(multihost, "protocol", lambda proto=proto: proto)
        try:
            multihost.check_same_config(group, c)
        except RunRefused:
            pass
    both = np.stack(rows)  # now every process's verdict, as the collective gives it
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda mine: both)
    for group, proto, c in processes:
        monkeypatch.setattr(multihost, "protocol", lambda proto=proto: proto)
        with pytest.raises(RunRefused) as info:
            multihost.check_same_config(group, c)
        errors.append(str(info.value))
    return errors


def test_processes_of_another_grpo_stream_version_are_refused_naming_the_version(monkeypatch):
    """Same config file, another grpo-stream on host 1: every process's refusal says so (not "another config")."""
    for error in verdicts(monkeypatch, follower_protocol="an older grpo-stream"):
        assert "another version of grpo-stream" in error and "Install the same grpo-stream" in error
        assert "configs other than" not in error


def test_a_config_that_differs_in_one_setting_is_still_blamed_on_the_config(monkeypatch):
    for error in verdicts(monkeypatch, follower_protocol=multihost.protocol(),
                          overrides=["trainer.learning_rate=0.5"]):
        assert "trainer.learning_rate (process(es) [1])" in error and "configs other than" in error
        assert "version" not in error


def test_an_authentic_message_of_another_version_names_the_version():
    """A field this version does not know, sealed with the job's secret (so process 0's): the error names the version
    skew, not only the field."""
    raw = CODEC.seal("msg", 0, Step(step=1, checkpoint=False, publish=True))
    size = int.from_bytes(raw[40:44], "big")
    header = json.loads(raw[44:44 + size])
    header["message"]["new_field"] = 1  # what a newer process 0 would send
    head = json.dumps(header, separators=(",", ":")).encode()
    signed = len(head).to_bytes(4, "big") + head + raw[44 + size:]
    sealed = b"GRPOMSG1" + hmac.new(CODEC._mac_key, b"GRPOMSG1" + signed, hashlib.sha256).digest() + signed
    with pytest.raises(ControlMessageError, match="new_field|different versions of grpo-stream") as info:
        CODEC.open("msg", 0, sealed, "key k")
    assert "different versions of grpo-stream" in str(info.value)


def test_a_setting_only_one_host_has_is_blamed_on_the_config_not_the_version(monkeypatch):
    """A mapping given one more entry on one host (task.rewards.last_number=0.5) adds a setting process 0 has not,
    with the same grpo-stream: every refusal sent users to reinstall grpo-stream on every host."""
    leader_error, follower_error = verdicts(monkeypatch, follower_protocol=multihost.protocol(),
                                            overrides=["task.rewards.last_number=0.5"])
    for error in (leader_error, follower_error):
        assert "configs other than trainer process 0's" in error and "Install the same grpo-stream" not in error
        assert "process(es) [1] have settings process 0 has not" in error
    assert "(here: task.rewards.last_number)" in follower_error and "their logs name them" in leader_error
