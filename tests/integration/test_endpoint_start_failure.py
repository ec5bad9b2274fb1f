"""An endpoint that cannot start (its port taken) stops what it had started: the sampler fails with the reason, and
no idle-serving thread is left polling its queue for ever, holding the engine and the sampler's weights, in a process
that goes on (`colocated`, a test's); nor is the engine left pointing at the dead endpoint's queue."""

import socket
import threading

import pytest

from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.engine import continuous
from grpo_stream.sampler_service.openai_server import openai_endpoint
from tests.conftest import CONFIGS


def test_an_endpoint_whose_port_is_taken_leaves_no_thread_behind():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        cfg = load_config(CONFIGS / "tiny_arith.yaml", [
            "model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
            f"sampler.openai.port={busy.getsockname()[1]}", "auth.mode=none"])
        _, tok = build_task_and_tokenizer(cfg)
        model = build_policy(cfg, tok.vocab_size, seed=0)
        engine = continuous.build(cfg, model, tok)
        with pytest.raises(RuntimeError, match="did not start"):
            with openai_endpoint(cfg, 0, "sampler-7", engine, tok, lambda: (model.params, 1), None):
                pass
    assert [t.name for t in threading.enumerate() if t.name.startswith("sampler-7-openai")] == []
    assert engine.side is None
