"""bench rollouts' acknowledging sink: the "useful tokens/s" of its multi-turn arms count what the model sampled."""

import numpy as np

from grpo_stream.bench.rollouts import AckingSink
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits, to_proto


def test_observation_tokens_of_a_multi_turn_episode_are_not_counted_as_useful():
    """A tool's answer spliced into an episode (model_token_mask 0) is prompt to the model's next turn, not work the
    sampler did: counting it inflated the multi-turn arms' tokens/s about twofold (half their tokens are the tool's)."""
    mask = np.array([1, 1, 0, 0, 0, 1, 1, 1], np.bool_)  # 5 sampled, 3 observed (logprob 0: not sampled)
    episode = CompletionData(np.arange(3, 11, dtype=np.int32), -mask.astype(np.float32), 1.0, False, {},
                             model_mask=mask)
    single_turn = CompletionData(np.array([4, 5, 6, 7], np.int32), -np.ones(4, np.float32), 0.0, False, {})
    group = GroupData("bench/g0", "p0", np.array([1, 2], np.int32), [episode, single_turn], policy_version=0,
                      sampler_id="bench", injected=True)
    sink = AckingSink(GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=16, vocab_size=32))
    assert sink.put(to_proto(group))
    assert sink.acked == 1 and sink.tokens == 5 + 4  # every token of a completion without a mask
