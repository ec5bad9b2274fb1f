"""write_private: the secrets files (token table, tokens, Redis password) end up 0600 and whole, whatever was there."""

import os
import stat

import yaml

from grpo_stream.common.rpc.auth import write_private, write_tokens


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_an_existing_file_with_a_looser_mode_ends_up_0600(tmp_path):
    path = tmp_path / "admin.token"
    path.write_text("old token\n")
    os.chmod(path, 0o644)  # e.g. left readable by hand, or by an older version
    write_private(path, "new token\n")
    assert path.read_text() == "new token\n"
    assert _mode(path) == 0o600


def test_a_symlink_planted_at_the_path_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    os.chmod(victim, 0o644)
    path = tmp_path / "client.token"
    path.symlink_to(victim)
    write_private(path, "secret\n")
    assert victim.read_text() == "someone else's file\n" and _mode(victim) == 0o644
    assert not path.is_symlink() and path.read_text() == "secret\n" and _mode(path) == 0o600


def test_write_tokens_over_a_loose_earlier_set_leaves_every_file_0600_and_no_temporary_files(tmp_path):
    out = tmp_path / "auth"
    first = write_tokens(out)
    for path in first.values():
        os.chmod(path, 0o664)
    again = write_tokens(out)
    assert {_mode(p) for p in again.values()} == {0o600}
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in again.values())
    assert len(yaml.safe_load(again["table"].read_text())) == 3
