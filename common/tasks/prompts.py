"""Prompt templates: how a question becomes the text a model continues (config task.prompt_template).

- plain: `Q: <question> A:` after the tokenizer's BOS text (the arith demo format).
- chat: the tokenizer's chat template, the question as the user turn, ready for the assistant's reply.
- reasoning: the chat template with a system turn asking for the answer format of the Tunix GSM8K demo,
  `<reasoning>...</reasoning><answer>...</answer>`, which `reasoning_answer_format` rewards.
- tools: the chat template with the environment's tools (`tools=`, environment.name=gsm8k_tools) and a system turn
  asking for tool use and a final `#### N`.
"""

from __future__ import annotations

REASONING_SYSTEM = ("Solve the problem. First write your step-by-step reasoning between <reasoning> and "
                    "</reasoning>. Then write only the final numerical answer between <answer> and </answer>.")
PLAIN = "Q: {question} A:"
TOOLS_SYSTEM = ("Solve the problem. You may call the tools to compute; their results come back to you. When you "
                "know the answer, write it on the last line as #### followed by the number, with no tool call.")


def render(question: str, template: str, tokenizer, tools: list[dict] | None = None) -> str:
    if template == "plain":
        return tokenizer.bos_text + PLAIN.format(question=question)
    if template == "chat":
        return tokenizer.chat_prompt([{"role": "user", "content": question}])
    if template == "reasoning":
        return tokenizer.chat_prompt([{"role": "system", "content": REASONING_SYSTEM},
                                      {"role": "user", "content": question}])
    if template == "tools":
        return tokenizer.render_chat([{"role": "system", "content": TOOLS_SYSTEM},
                                      {"role": "user", "content": question}], add_generation_prompt=True,
                                     tools=tools)
    raise ValueError(f"task.prompt_template={template!r}: choose plain, chat, reasoning or tools")
