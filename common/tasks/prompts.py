"""Prompt templates: how a question becomes the text a model continues (config task.prompt_template).

- plain: `Q: <question> A:` after the tokenizer's BOS text (the arith demo format).
- chat: the tokenizer's chat template, the question as the user turn, ready for the assistant's reply.
- reasoning: the chat template with a system turn asking for the answer format of the Tunix GSM8K demo,
  `<reasoning>...</reasoning><answer>...</answer>`, which `reasoning_answer_format` rewards.
"""

from __future__ import annotations

REASONING_SYSTEM = ("Solve the problem. First write your step-by-step reasoning between <reasoning> and "
                    "</reasoning>. Then write only the final numerical answer between <answer> and </answer>.")
PLAIN = "Q: {question} A:"


def render(question: str, template: str, tokenizer) -> str:
    if template == "plain":
        return tokenizer.bos_text + PLAIN.format(question=question)
    if template == "chat":
        return tokenizer.chat_prompt([{"role": "user", "content": question}])
    if template == "reasoning":
        return tokenizer.chat_prompt([{"role": "system", "content": REASONING_SYSTEM},
                                      {"role": "user", "content": question}])
    raise ValueError(f"task.prompt_template={template!r}: choose plain, chat or reasoning")
