"""Token data: from input files to the micro-batches a training step reads.

Offline, `dskit data prepare` (outside the container's trainer):
- `prepare`: inputs -> a shard directory, atomically; the eval split (`held_out`).
- `readers`: the input files (text, JSONL, each also .gz/.zst, Parquet, Arrow, `datasets` dirs) as
  records: a text, or a chat record's messages.
- `chat`: chat records checked, and rendered into tokens with their loss mask.
- `encode`: records -> (tokens, mask) in input order, in one process or a pool of them.

At run time (the trainer imports only these):
- `shards`: the shard format, written (`ShardWriter`) and read (`TokenData`).
- `sampler`: `Sampler`, `Mixture`, `sample_index`, `DataPosition`: which samples a step reads.
- `packing`: which whole chat samples share a row (`best_fit`).
- `tokenizers`, `corpus`: the byte tokenizer and the embedded corpus, tokenized at start when a run
  gives no data (and the Hugging Face tokenizer, for prepare).

The two constants below live here, not in `sampler`, so that their other readers import them without
numpy: the spec (the core install has none) and the trainer's loss.
"""

#: samples are drawn in blocks of this many, each source getting its share of every block
#: (`sampler.Mixture`; the spec refuses a weight that would get no slot)
MIXTURE_BLOCK = 1024

IGNORE_INDEX = -100  # labels with this value carry no loss (transformers' convention)
