"""Prompt templates: how a question becomes the text a model continues (config task.prompt_template). Every task
renders its prompts here (`renderer`), so samplers, the trainer's warm start and evaluation, and injected questions
(`grpo-stream submit`) see the same text.

- plain: `Q: <question> A:` after the tokenizer's BOS text (the arith demo format; the tiny tokenizer has no BOS).
  For an instruct model whose BOS is a chat role token (SmolLM2's `<|im_start|>`) this makes the question a role
  header: use `chat`.
- chat: the tokenizer's chat template, the question as the user turn (after a system turn when task.system_prompt
  is set), ready for the assistant's reply. Rendered by `render_chat(..., add_generation_prompt=True)`, the call the
  OpenAI-compatible endpoint renders a chat request with: the same messages give the same ids there.
- reasoning: the chat template with a system turn asking for the answer format of the Tunix GSM8K demo,
  `<reasoning>...</reasoning><answer>...</answer>`, which `reasoning_answer_format` rewards (task.system_prompt
  replaces that system turn).
- tools: the chat template with the environment's tools (`tools=`, environment.name=gsm8k_tools) and a system turn
  asking for tool use and a final `#### N` (task.system_prompt replaces it).
"""

from __future__ import annotations

from typing import Callable

REASONING_SYSTEM = ("Solve the problem. First write your step-by-step reasoning between <reasoning> and "
                    "</reasoning>. Then write only the final numerical answer between <answer> and </answer>.")
PLAIN = "Q: {question} A:"
TOOLS_SYSTEM = ("Solve the problem. You may call the tools to compute; their results come back to you. When you "
                "know the answer, write it on the last line as #### followed by the number, with no tool call.")
TEMPLATES = ("plain", "chat", "reasoning", "tools")
_OWN_SYSTEM = {"reasoning": REASONING_SYSTEM, "tools": TOOLS_SYSTEM}  # a template's system turn by default


def chat_messages(question: str, template: str, system: str | None = None) -> list[dict]:
    """The messages a chat-form template renders: an optional system turn (task.system_prompt, else the template's
    own), then the question as the user turn."""
    system = system if system is not None else _OWN_SYSTEM.get(template)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def render(question: str, template: str, tokenizer, tools: list[dict] | None = None,
           system: str | None = None) -> str:
    """The prompt text of `question` by `template` (module doc); `system`: task.system_prompt."""
    if template == "plain":
        if system:
            raise ValueError("task.system_prompt needs a chat-form task.prompt_template (chat, reasoning or tools); "
                             "'plain' has no system turn")
        return tokenizer.bos_text + PLAIN.format(question=question)
    if template not in TEMPLATES:
        raise ValueError(f"task.prompt_template={template!r}: choose plain, chat, reasoning or tools")
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError(f"task.prompt_template={template}: this tokenizer has no chat template; use 'plain' (the "
                         "tiny model's tokenizer never has one)")
    return tokenizer.render_chat(chat_messages(question, template, system), add_generation_prompt=True,
                                 tools=tools if template == "tools" else None)


def renderer(cfg, tokenizer, tools: list[dict] | None = None,
             templates: tuple[str, ...] = TEMPLATES) -> Callable[[str], str]:
    """question -> prompt text by the run's task.prompt_template and task.system_prompt; `templates`: those the task
    takes (another is refused naming them)."""
    template, system = cfg.task.prompt_template, cfg.task.system_prompt
    if template not in templates:
        raise ValueError(f"task.prompt_template={template}: task.name={cfg.task.name} takes {', '.join(templates)}")
    render(".", template, tokenizer, tools, system)  # refuse a template the tokenizer cannot render now, not later
    return lambda question: render(question, template, tokenizer, tools, system)
