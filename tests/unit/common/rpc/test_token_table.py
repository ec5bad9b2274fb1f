"""A token table file's entries as YAML reads them."""

import pytest

from grpo_stream.common.rpc.auth import AuthError, TokenTable


@pytest.mark.parametrize("written", ["0x1234567890abcdef12", "0123456701234567012", "1_000_000_000_000_000_000"])
def test_a_token_yaml_reads_as_a_number_is_refused_with_how_to_fix_it(tmp_path, written):
    """Unquoted, YAML reads these as integers, whose text is not what was written: the table held a token no
    client has, and the one the client sends was refused (UNAUTHENTICATED) with no word why."""
    path = tmp_path / "tokens.yaml"
    path.write_text(f"- name: a\n  role: client\n  token: {written}\n")
    with pytest.raises(AuthError, match=r"entry 0 \(a\): YAML reads the token as int.*put it in quotes"):
        TokenTable.from_file(path)
    path.write_text(f"- name: a\n  role: client\n  token: '{written}'\n")
    assert TokenTable.from_file(path).lookup(written).name == "a"
