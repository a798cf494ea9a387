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


# A long-tailed chat set, by shape: 9,000 chats of 1-3 turns, 214 tokens on average, long-tailed to 1,800.
LONG_TAIL_CHATS, LONG_TAIL_MAX = 9000, 1800


def long_tail_chats(n: int = LONG_TAIL_CHATS, seed: int = 0) -> list[list[tuple[int, int]]]:
    """Per chat, its turns' (user, assistant) token counts: a chat's tokens are lognormal (median 146,
    sigma 0.9) cut to [24, LONG_TAIL_MAX], 214 on average; 1, 2 or 3 turns (half, 30%, 20%) share
    them at random, each turn's user part 15-50% of it."""
    import numpy as np

    rng = np.random.default_rng([seed, 61])
    totals = np.exp(rng.normal(np.log(146), 0.9, n))
    totals = np.clip(np.rint(totals), 24, LONG_TAIL_MAX).astype(int)
    out = []
    for total in totals.tolist():
        k = int(rng.choice([1, 2, 3], p=[0.5, 0.3, 0.2]))
        cuts = np.sort(rng.choice(np.arange(4, total - 3, 4), size=k - 1, replace=False)) if k > 1 else []
        turns = np.diff([0, *cuts, total]).tolist()
        chat = []
        for t in turns:
            user = max(1, int(t * rng.uniform(0.15, 0.5)))
            chat.append((user, t - user))
        out.append(chat)
    return out


def write_long_tail_shards(out: Path, n: int = LONG_TAIL_CHATS, seed: int = 0) -> Path:
    """`long_tail_chats` as a chat shard directory of the byte tokenizer (what `dskit data prepare`
    writes, read back by TokenData.open): each turn's user part is English text from the embedded
    corpus with no loss, its assistant part the text that follows with the loss, ended by EOS. Byte
    tokens of the corpus that runs without data: a GPU run compares with plain text like for like."""
    import numpy as np

    from dskit.data.corpus import embedded_corpus
    from dskit.data.shards import ShardWriter
    from dskit.data.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    text = tok.encode("\n\n".join(embedded_corpus()))
    writer = ShardWriter(out, np.uint16, chat=True)
    at = 0
    for chat in long_tail_chats(n, seed):
        ids, mask = [], []
        for user, reply in chat:
            ids.append(np.take(text, np.arange(at, at + user + reply - 1), mode="wrap"))
            ids.append(np.asarray([tok.eos_id], dtype=np.uint32))
            mask.append(np.repeat(np.asarray([0, 1], dtype=np.uint8), [user, reply]))
            at += user + reply - 1
        writer.add(np.concatenate(ids), np.concatenate(mask))
    writer.close(tok)
    return out


def epoch_packing_efficiency(sampler, micro_batch: int = 8) -> float:
    """What the trainer logs as packing_efficiency (dskit/train/metrics.py: its micro-batches' real
    tokens over their rows' capacity), over one epoch of a Sampler's rows, read as the trainer reads
    them (bench/chat_bench.py --packing reports it too)."""
    batches = sampler.windows // micro_batch
    real = sum(sampler.get(i * micro_batch, micro_batch).real_tokens for i in range(batches))
    return real / (batches * micro_batch * sampler.seq_len)
