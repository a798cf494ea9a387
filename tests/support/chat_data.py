"""A tiny chat tokenizer and chat set for the SFT tests, made on the spot (nothing downloaded).

The tokenizer is byte-level BPE trained with the `tokenizers` library on the chat set itself, with a
chat template shaped like DeepSeek's (`User: ...\\n\\nAssistant: ...<eos>`), saved as a local
Hugging Face tokenizer directory exactly like a published one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# DeepSeek-V2-Chat's template, shortened: system text first, "User: " turns, "Assistant: " turns ended
# by EOS, and "Assistant:" as the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token }}"
    "{% else %}{{ m['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
BOS, EOS, PAD = "<|begin|>", "<|end|>", "<|pad|>"

WORDS = "red green blue yellow cat dog bird fish one two three four big small fast slow".split()


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Learnable chats: the assistant repeats the user's words in reverse order."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(2, 5))
        msgs = [
            {"role": "system", "content": "Reverse the words."},
            {"role": "user", "content": " ".join(words)},
            {"role": "assistant", "content": " ".join(reversed(words))},
        ]
        if rng.random() < 0.3:  # a second turn now and then: masks must cover every assistant turn
            more = rng.sample(WORDS, 2)
            msgs += [
                {"role": "user", "content": " ".join(more)},
                {"role": "assistant", "content": " ".join(reversed(more))},
            ]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_tokenizer(out: Path, vocab_size: int = 300) -> Path:
    """Byte-level BPE (so any text encodes) with BOS/EOS/PAD and the chat template, saved to `out`."""
    text = [m["content"] for c in conversations(200) for m in c["messages"]]
    return make_tokenizer_from(out, text, vocab_size)


def make_tokenizer_from(out: Path, text: list[str], vocab_size: int) -> Path:
    """`make_tokenizer` trained on `text` (bench/chat_bench.py trains one on its generated chat set)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*text, "User: ", "Assistant: "], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return out
