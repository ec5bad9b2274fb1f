"""The seal on the multi-process trainer's messages (trainer_service/control_messages.py): an authentic message
opens to its typed fields and arrays; a forged, tampered, replayed, reordered, mistyped or other-incarnation one is
refused with an error naming what is wrong; the secret comes from the environment or a private file only."""

import os

import numpy as np
import pytest

from grpo_stream.trainer_service.control_messages import (SECRET_ENV, SECRET_FILE_ENV, ControlCodec,
                                                          ControlMessageError, Hosts, Start, Step, load_secret)

SECRET = b"s" * 64
ARRAYS = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "advantages": np.array([0.5, -1.0, 2.0], np.float32)}


def codec(secret: bytes = SECRET, incarnation: bytes = b"\x01" * 16) -> ControlCodec:
    return ControlCodec(secret, incarnation)


def step(n: int = 3) -> Step:
    return Step(step=n, checkpoint=True, publish=False)


def test_an_authentic_message_opens_to_its_fields_and_arrays():
    c = codec()
    message, arrays = c.open("msg", 5, c.seal("msg", 5, step(), ARRAYS), "k")
    assert message == step() and sorted(arrays) == sorted(ARRAYS)
    for name, value in ARRAYS.items():
        np.testing.assert_array_equal(arrays[name], value)
        assert arrays[name].dtype == value.dtype


def test_a_message_sealed_without_the_secret_is_refused_as_forged():
    raw = codec(secret=b"x" * 64).seal("msg", 0, Start(epoch="e1", restore=4))
    with pytest.raises(ControlMessageError, match=r"at grpo/msg/x .*message 0.* fails authentication \(bad MAC\)"):
        codec().open("msg", 0, raw, "grpo/msg/x")


def test_a_changed_byte_anywhere_is_refused():
    """The review's attack: the batch's arrays rewritten in place (here one advantage flipped in sign)."""
    raw = bytearray(codec().seal("msg", 2, step(), ARRAYS))
    flipped = bytes(np.array([0.5, 1.0, 2.0], np.float32))
    at = bytes(raw).index(bytes(ARRAYS["advantages"]))
    raw[at:at + len(flipped)] = flipped
    with pytest.raises(ControlMessageError, match="bad MAC"):
        codec().open("msg", 2, bytes(raw), "k")


@pytest.mark.parametrize("raw", [b"", b"{\"kind\": \"finish\", \"steps\": 3}", b"GRPOMSG1" + b"\0" * 10])
def test_a_value_that_is_no_sealed_message_is_refused(raw):
    """What the old unsealed format, or junk, looks like in the store."""
    with pytest.raises(ControlMessageError, match="not a sealed trainer message|bad MAC"):
        codec().open("msg", 0, raw, "k")


def test_a_replayed_or_reordered_message_is_refused():
    c = codec()
    old = c.seal("msg", 3, step(3), ARRAYS)  # authentic, but message 3
    with pytest.raises(ControlMessageError, match="is msg message 3: a replayed or reordered message"):
        c.open("msg", 4, old, "k")
    with pytest.raises(ControlMessageError, match="is msg message 3"):
        c.open("msg", 2, old, "k")


def test_a_message_of_another_start_of_the_job_is_refused_even_with_the_same_secret():
    earlier = codec(incarnation=b"\x02" * 16).seal("msg", 0, Start(epoch="e0"))
    with pytest.raises(ControlMessageError, match="belongs to another start of the job .*a replayed message"):
        codec().open("msg", 0, earlier, "k")


def test_a_message_of_another_stream_or_kind_is_refused():
    c = codec()
    announcement = c.seal("hosts", 7, Hosts(epoch="e1", version=7, process=1, address="10.0.0.2", port=5,
                                             data_port=0))
    with pytest.raises(ControlMessageError, match="is hosts message 7"):
        c.open("msg", 7, announcement, "k")
    with pytest.raises(ValueError):  # the writer cannot seal a kind its stream does not carry
        c.seal("hosts", 7, step())


def test_fields_that_do_not_fit_their_kind_are_refused_even_when_authentic():
    """What a message that passed its MAC must still be (a writer of another grpo-stream version could send other
    fields): a kind of its stream, fields of that kind's types and no others."""
    refuse = ControlMessageError
    with pytest.raises(ControlMessageError, match="of kind 'exec', not one of start, step, finish, done"):
        ControlCodec._parse("msg", {"kind": "exec"}, b"", refuse)
    with pytest.raises(ControlMessageError, match=r"(?s)do not parse as a 'step' message.*step\.step"):
        ControlCodec._parse("msg", {"kind": "step", "step": "1; rm -rf /", "checkpoint": True, "publish": False}, b"",
                            refuse)
    with pytest.raises(ControlMessageError, match=r"(?s)do not parse as a 'start' message.*run.*[Ee]xtra"):
        ControlCodec._parse("msg", {"kind": "start", "epoch": "e", "run": "os:popen"}, b"", refuse)
    with pytest.raises(ControlMessageError, match="arrays that do not load"):
        ControlCodec._parse("msg", {"kind": "done"}, b"not an npz", refuse)


def test_key_names_depend_on_the_secret_the_incarnation_and_the_position():
    c = codec()
    names = {c.key("msg", 0), c.key("msg", 1), codec(incarnation=b"\x03" * 16).key("msg", 0),
             codec(secret=b"y" * 64).key("msg", 0), c.key("hosts", 0, "e1", 0), c.key("hosts", 0, "e1", 1)}
    assert len(names) == 6 and all(n.startswith(("grpo/msg/", "grpo/hosts/")) for n in names)
    assert "grpo/msg/0" not in names  # the names the old code used, which anyone could write ahead


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path):
    assert load_secret({SECRET_ENV: "a" * 40}) == b"a" * 40
    path = tmp_path / "trainer.secret"
    path.write_text("b" * 64 + "\n")
    os.chmod(path, 0o600)
    assert load_secret({SECRET_FILE_ENV: str(path)}) == b"b" * 64
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match=f"{SECRET_FILE_ENV}=.*readable or writable by other users .*chmod 600"):
        load_secret({SECRET_FILE_ENV: str(path)})
    with pytest.raises(ValueError, match=f"trainer.processes > 1.*{SECRET_FILE_ENV}.*{SECRET_ENV}"):
        load_secret({})
    with pytest.raises(ValueError, match=f"{SECRET_ENV}: .* has 5 characters; use at least 32"):
        load_secret({SECRET_ENV: "short"})
    with pytest.raises(ValueError, match=f"{SECRET_FILE_ENV}=.*cannot read"):
        load_secret({SECRET_FILE_ENV: str(tmp_path / "missing")})
