"""What Submit writes to Redis for a prompt: the fields PromptService checked, nothing a client added beside them."""

import pytest

from grpo_stream.protos import prompts_pb2
from tests.integration.test_prompt_service import prompt_stack

pytestmark = pytest.mark.redis


def unknown_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field `number` no PromptSpec declares, as protobuf's wire format writes it."""
    def varint(n: int) -> bytes:
        out = b""
        while n > 0x7F:
            out += bytes([(n & 0x7F) | 0x80])
            n >>= 7
        return out + bytes([n])
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def test_fields_a_prompt_spec_does_not_declare_are_not_stored(tiny_parts, shared_redis, run_name, tmp_path):
    """protobuf keeps the unknown fields of what it parses and writes them out again: 4 MiB beside a 6-character
    prompt went into the prompt's hash in Redis (and the reserved field 9 too), so every queued prompt could carry
    most of a 64 MiB message past prompts.max_text_chars, and a client's quota of prompts fill Redis."""
    with prompt_stack(tiny_parts, shared_redis.url, run_name, tmp_path) as stack:
        spec = prompts_pb2.PromptSpec(text="Q: 1 A", tags=["t"]).SerializeToString()
        smuggled = spec + unknown_field(9, b"x" * 1024) + unknown_field(1000, b"y" * (4 << 20))
        request = prompts_pb2.SubmitRequest.FromString(unknown_field(1, smuggled))
        channel = stack.channel("client")
        submit = channel.unary_unary("/grpo_stream.v1.PromptService/Submit",
                                     request_serializer=prompts_pb2.SubmitRequest.SerializeToString,
                                     response_deserializer=prompts_pb2.SubmitReply.FromString)
        [pid] = submit(request, timeout=30).prompt_ids
        stored = stack.buffer.client.hget(f"{stack.buffer.base}:prompt:{pid}", "spec")
        assert prompts_pb2.PromptSpec.FromString(stored) == prompts_pb2.PromptSpec(text="Q: 1 A", tags=["t"])
        assert len(stored) < 64
