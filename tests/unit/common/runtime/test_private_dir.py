"""Which cache directories code may be loaded from: this user's own, written by no one else. Modes are checked on
real directories (chmod); another owner by making the check believe it runs as another uid."""

import os
import stat

import pytest

from grpo_stream.common.runtime.private_dir import make_private_dir, untrusted_reason


def tree(root, dir_mode: int, file_mode: int):
    root.mkdir()
    (root / "sub").mkdir()
    for path in (root / "entry", root / "sub" / "deep"):
        path.write_bytes(b"compiled code")
        os.chmod(path, file_mode)
    os.chmod(root, dir_mode)
    return root


def test_a_directory_only_this_user_can_reach_is_trusted_whatever_its_entries_modes(tmp_path):
    assert untrusted_reason(tree(tmp_path / "c", 0o700, 0o666)) is None  # no one else can reach the entries
    assert untrusted_reason(tree(tmp_path / "d", 0o755, 0o644)) is None  # others read, nobody else writes


@pytest.mark.parametrize("dir_mode,file_mode,reason", [
    (0o775, 0o644, "it is writable by group or others (mode 0775)"),
    (0o757, 0o600, "it is writable by group or others (mode 0757)"),
    (0o755, 0o664, "entry is writable by group or others (mode 0664)"),
    (0o711, 0o646, "is writable by group or others (mode 0646)"),
])
def test_what_others_could_have_written_is_not_trusted(tmp_path, dir_mode, file_mode, reason):
    assert reason in untrusted_reason(tree(tmp_path / "c", dir_mode, file_mode))


def test_a_subdirectorys_entries_are_checked_too(tmp_path):
    root = tree(tmp_path / "c", 0o755, 0o644)
    os.chmod(root / "sub" / "deep", 0o666)
    assert "sub/deep is writable by group or others" in untrusted_reason(root)


def test_another_owner_is_not_trusted(tmp_path, monkeypatch):
    root = tree(tmp_path / "c", 0o700, 0o600)
    monkeypatch.setattr(os, "getuid", lambda: root.stat().st_uid + 4242)
    assert f"is owned by uid {root.stat().st_uid}, not by this user" in untrusted_reason(root)


def test_links_are_not_followed(tmp_path):
    real = tree(tmp_path / "real", 0o700, 0o600)
    (tmp_path / "link").symlink_to(real)
    assert "not a directory" in untrusted_reason(tmp_path / "link")
    (real / "lib.so").symlink_to("/elsewhere/lib.so")
    assert "lib.so is a symbolic link" in untrusted_reason(real)


def test_a_new_directory_is_made_private(tmp_path):
    assert make_private_dir(tmp_path / "a" / "b") is None
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700


def test_a_directory_under_one_others_may_write_is_not_trusted(tmp_path):
    """Only the directory itself was checked: under a parent others may write (no sticky bit), someone else can
    rename the checked cache away afterwards and put theirs in its place, which JAX then reads all run long."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert "shared above it is writable by group or others (mode 0777" in make_private_dir(shared / "cache")
    sticky = tmp_path / "sticky"  # as /tmp: only an entry's owner may rename it
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    assert make_private_dir(sticky / "cache") is None


def test_missing_parents_are_made_private_too(tmp_path):
    old = os.umask(0o002)  # user private groups: os.makedirs would make the parents group-writable
    try:
        assert make_private_dir(tmp_path / "home" / ".cache" / "grpo-stream") is None
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700
