"""Chat records: their messages checked, and rendered into tokens with the loss mask of their replies."""

from __future__ import annotations

import numpy as np

from dskit.errors import SpecError

ROLES = ("system", "user", "assistant")


def check_messages(where: str, msgs: object) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise SpecError(where, "'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise SpecError(
                f"{where} messages[{i}]", f"needs a 'role' (one of {', '.join(ROLES)}) and a string 'content'"
            )
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise SpecError(
                f"{where} messages[{i}]", "'content' holds an unpaired surrogate escape"
            ) from None
    if not any(m["role"] == "assistant" for m in msgs):
        raise SpecError(where, "no 'assistant' message: nothing to train on")
    if msgs[0]["role"] == "assistant":
        raise SpecError(where, "starts with an 'assistant' message: a conversation opens with system or user")
    return msgs


def encode_chat(messages: list[dict], tok) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, mask) of one conversation rendered with the tokenizer's own chat template; mask 1 on
    the assistant turns' tokens (their content and the template's end-of-turn, so the model learns to
    stop), 0 on everything else.

    The template is rendered once per assistant turn: the conversation before it with the generation
    prompt (`Assistant:` in DeepSeek's template) is context; the text the full turn adds after that is
    the target. Each piece is tokenized on its own, so the mask follows the turn boundaries exactly
    (tokenizing the whole text could merge characters across a boundary into one token)."""
    render = getattr(tok, "render_chat", None)
    if render is None:
        raise SpecError(
            "--tokenizer",
            "chat records ('messages') need a local tokenizer dir with a chat template, not 'byte'",
        )
    pieces: list[tuple[str, int]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(messages[:i], generation_prompt=True)
        full = render(messages[: i + 1], generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise SpecError(
                "--tokenizer",
                f"{tok.name}: its chat template does not render a conversation as a prefix of the longer one; "
                "loss masks need a prefix-stable template",
            )
        pieces += [(prompt[len(done) :], 0), (full[len(prompt) :], 1)]
        done = full
    last = render(messages, generation_prompt=False)
    if not last.startswith(done):
        raise SpecError("--tokenizer", f"{tok.name}: its chat template is not prefix-stable")
    pieces.append((last[len(done) :], 0))  # trailing non-assistant turns: context with nothing to predict
    ids = [tok.encode(t) for t, _ in pieces]
    mask = [np.full(len(x), k, dtype=np.uint8) for x, (_, k) in zip(ids, pieces, strict=True)]
    return np.concatenate(ids).astype(np.uint32), np.concatenate(mask)
