"""A client token that a gRPC header cannot carry (the token table given for the token, a file of two lines, one not
UTF-8 or not ASCII) is refused before any call, naming where it came from."""

import pytest

from grpo_stream.cli import main
from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rpc.grpc_util import ClientSecurity

NOTHING_LISTENS = "127.0.0.1:9"


@pytest.mark.parametrize("content", [b"- name: client\n  role: client\n  token: abc\n", b"abc\ndef\n",
                                     "t\u00f8ken\n".encode(), b"\xff\xfetoken\n", b"abc\tdef\n"])
def test_a_token_file_no_header_can_carry_is_named_and_exits_2(content, tmp_path, capsys):
    """Such a token was sent as is: gRPC refused its header ("INTERNAL: Invalid metadata", exit 1, naming no file),
    and `results ID` retried INTERNAL as a broken stream for the whole --wait; a file not UTF-8 said only "'utf-8'
    codec can't decode"."""
    path = tmp_path / "tokens.yaml"
    path.write_bytes(content)
    assert main(["status", "--address", NOTHING_LISTENS, "--wait", "0.5", "--token-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--token-file {path}:" in err and "one line of printable ASCII" in err


def test_a_token_from_elsewhere_no_header_can_carry_is_refused_at_once():
    with pytest.raises(ValueError, match="one line of printable ASCII"):
        PromptClient(NOTHING_LISTENS, ClientSecurity(token="abc\ndef"))


def test_a_token_of_printable_ascii_is_taken(tmp_path):
    PromptClient(NOTHING_LISTENS, ClientSecurity(token="Ab0-_~.+/= x")).close()
