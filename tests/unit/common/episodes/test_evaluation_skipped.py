"""Problems whose prompts the engine cannot take are left out of every figure: the evaluation says so in its log,
naming the setting, not only in the JSON's counts (accuracy over the shorter problems only read as the split's)."""

import logging
import types

from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.episodes.evaluation import evaluate


def test_prompts_too_long_are_skipped_with_a_warning_naming_the_setting(tiny_parts, caplog):
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens, 4, temperature=1.0)
    problems = task.heldout(2)
    long = types.SimpleNamespace(prompt=problems[0].prompt * 20, answer="1", prompt_id="long")
    assert len(tok.encode(long.prompt)) > engine.max_prompt_tokens
    with caplog.at_level(logging.WARNING, logger="grpo_stream.common.episodes.evaluation"):
        result = evaluate(engine, model.params, tok, [problems[0], long, problems[1]], batch_size=4)
    assert (result.num_problems, result.skipped_long_prompts, result.skipped_empty_prompts) == (2, 1, 0)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("evaluating 2 of 3 problems" in m and "generation.max_prompt_tokens" in m for m in warned), warned


def test_no_warning_when_every_prompt_is_scored(tiny_parts, caplog):
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens, 4, temperature=1.0)
    with caplog.at_level(logging.WARNING, logger="grpo_stream.common.episodes.evaluation"):
        result = evaluate(engine, model.params, tok, task.heldout(2), batch_size=4)
    assert result.num_problems == 2 and not [r for r in caplog.records if "problems:" in r.getMessage()]
