"""The paper's prompts: the question plus a fixed instruction, wrapped in the chat template."""

from __future__ import annotations

from typing import Any

from vase.eval.tasks import Problem, task_kind

__all__ = ["MATH_SUFFIX", "GSM8K_SUFFIX", "RECALL_SUFFIX", "prompt_suffix", "build_user_message", "build_prompt"]

# Exactly the paper's strings (the VaSE paper, arXiv 2606.03928); note the newline vs the space.
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_SUFFIX = " Put your final answer within \\boxed{}."
# The embedded recall task: small models do not box, but they do write "The answer is N." when asked
# (SmolLM2-135M answers 9 of 10 this way, 1 of 10 when asked to write the steps out first).
RECALL_SUFFIX = " Reply in one sentence: 'The answer is N.'"


def prompt_suffix(task: str) -> str:
    """Instruction appended to a question of ``task`` (GSM8K/arith, recall, math tasks)."""
    kind = task_kind(task)
    return GSM8K_SUFFIX if kind == "gsm8k" else RECALL_SUFFIX if kind == "recall" else MATH_SUFFIX


def build_user_message(problem: Problem) -> str:
    """The user turn: the question followed by the task's instruction."""
    return problem.question + prompt_suffix(problem.task)


def build_prompt(
    tokenizer: Any,
    problem: Problem,
    chat_template: bool = True,
    **template_kwargs: Any,
) -> str:
    """The full prompt text for ``problem``.

    With ``chat_template`` and a tokenizer that has one, the user message is rendered by
    ``tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)``;
    ``template_kwargs`` are passed through (e.g. ``enable_thinking=True`` for Qwen3).
    Otherwise (base models, templates switched off) the bare message is returned.
    """
    msg = build_user_message(problem)
    if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": msg}],
            tokenize=False,
            add_generation_prompt=True,
            **template_kwargs,
        )
    return msg
