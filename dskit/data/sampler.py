"""Which samples a step reads: `Sampler` (one shard directory), `Mixture` (several, by weight).

Two ways to cut training samples, chosen by the data's kind:
- text (continued pre-training): windows of seq_len+1 tokens that cross document boundaries, every
  token a target, as in GPT-style pre-training;
- chat (fine-tuning): whole samples packed into rows of seq_len, never split; each sample's position
  ids restart at 0, which transformers' DeepSeek path turns into attention confined to the sample
  (a block-diagonal causal mask for SDPA/eager, varlen for FlashAttention).

Sampling is a pure function of (seed, global sample number): resuming at step N reproduces exactly the
batches an uninterrupted run would have seen, with no loader state to save.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dskit.data import IGNORE_INDEX, MIXTURE_BLOCK
from dskit.data.packing import Packer, best_fit, one_per_row
from dskit.data.shards import Shard, TokenData
from dskit.errors import SpecError


@dataclass
class Batch:
    """One micro-batch: [n, width] int64 each, width seq_len (text, packed chat) or a length bucket
    (`pad`); labels are IGNORE_INDEX where no loss is taken; position_ids is None for text windows
    (positions 0..seq_len-1, attention across the window). `real_tokens`: the positions holding a
    sample's token, padding not counted (what honest throughput counts)."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray | None
    real_tokens: int


# `pad` rows are cut to the narrowest of these widths that holds the micro-batch's longest sample:
# seq_len, halved up to six times, in multiples of 8. Few shapes, so regional torch.compile
# (dynamic=False; dskit/train/compile.py sizes dynamo's recompile limit for them) compiles each
# once instead of once per length.
PAD_BUCKETS = 7


def pad_width(longest: int, seq_len: int) -> int:
    """The row width of a `pad` micro-batch whose longest sample takes `longest` positions."""
    widths = sorted({min(seq_len, -(-seq_len // (8 * 2**j)) * 8) for j in range(PAD_BUCKETS)})
    return next(w for w in widths if w >= min(longest, seq_len))


class Sampler:
    """Training samples addressed by global sample number, in a seeded permutation per epoch.

    Sample g of the run is unit perm_e[g mod U] with e = g // U: any rank can compute its samples for
    any step without state, so resume is exact and ranks never overlap. A unit is a window of seq_len+1
    tokens (text; windows stay inside one shard, losing under seq_len tokens per 256M-token shard) or a
    pack of whole samples (chat: the samples in a seeded order, packed into rows of seq_len by best fit
    over a bounded window of that order, dskit/data/packing.py; built once, so also a function of the
    seed).
    """

    def __init__(
        self, data: TokenData, seq_len: int, seed: int, *, packing: str = "pack", packer: Packer = best_fit
    ):
        self.data, self.seq_len, self.seed, self.packing = data, seq_len, seed, packing
        self.packer = packer  # which samples share a row (`packing: pack`); dskit/data/packing.py
        self.chat = data.kind == "chat"
        self.truncated = 0  # chat samples cut to seq_len+1 (text windows cut nothing)
        if self.chat:
            self._build_packs(packing)
            self.windows = len(self._pack_first) - 1
        else:
            per = [max(0, (len(s.tokens) - 1) // seq_len) for s in data.shards]
            self._shard_first = np.cumsum([0, *per])
            self.windows = int(self._shard_first[-1])
        if self.windows < 1:
            raise SpecError(
                "data.path",
                f"{data.source} has {data.n_tokens} tokens, fewer than seq_len+1 ({seq_len + 1})",
            )
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def describe(self) -> str:
        return f"{self.data.source}, {self.data.kind}, {self.data.n_tokens} tokens"

    def _build_packs(self, packing: str) -> None:
        """Chat packs, once: document d spans tokens [start, end) of its shard and takes L-1 row slots
        (its inputs are tokens[:-1], its labels tokens[1:]); one longer than seq_len+1 is cut to that
        (counted and logged by the caller through `truncated`). `packing='pad'`: one sample per row;
        `pack`: the rows `self.packer` makes of the seeded order."""
        starts, ends, shard_of = [], [], []
        for i, s in enumerate(self.data.shards):
            e = s.ends.astype(np.int64)
            starts.append(np.concatenate([[0], e[:-1]]))
            ends.append(e)
            shard_of.append(np.full(len(e), i, dtype=np.int32))
        self._starts, self._ends = np.concatenate(starts), np.concatenate(ends)
        self._shard = np.concatenate(shard_of)
        lengths = np.minimum(self._ends - self._starts, self.seq_len + 1)
        self.truncated = int(((self._ends - self._starts) > self.seq_len + 1).sum())
        order = np.random.default_rng([self.seed, 0xDA7A]).permutation(len(lengths))
        order = order[lengths[order] >= 2]  # one token predicts nothing
        packer = one_per_row if packing == "pad" else self.packer
        within, self._pack_first = packer(lengths[order] - 1, self.seq_len)
        self._order = order[within]

    def _unit(self, g: int) -> int:
        epoch, i = divmod(g, self.windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def _window(self, g: int) -> tuple[Shard, int]:
        w = self._unit(g)
        shard = int(np.searchsorted(self._shard_first, w, side="right")) - 1
        return self.data.shards[shard], (w - int(self._shard_first[shard])) * self.seq_len

    def batch(self, first_sample: int, n: int) -> np.ndarray:
        """[n, seq_len + 1] int64 token windows (text data) for global samples first_sample ...+n-1."""
        if self.chat:
            raise SpecError("data.path", f"{self.data.source} is chat data: read it with Sampler.get")
        out = np.empty((n, self.seq_len + 1), dtype=np.int64)
        for j in range(n):
            shard, s = self._window(first_sample + j)
            out[j] = shard.tokens[s : s + self.seq_len + 1]
        return out

    def get(self, first_sample: int, n: int) -> Batch:
        """The micro-batch of global samples first_sample .. first_sample + n - 1."""
        if not self.chat:
            w = self.batch(first_sample, n)
            return Batch(w[:, :-1], w[:, 1:], None, w[:, :-1].size)
        L = self.seq_len
        inputs = np.full((n, L), self.data.eos_id, dtype=np.int64)
        labels = np.full((n, L), IGNORE_INDEX, dtype=np.int64)
        # Padding gets its own run of positions 0.. so it reads as one more (label-less) sample.
        pos = np.tile(np.arange(L, dtype=np.int64), (n, 1))
        filled = np.zeros(n, dtype=np.int64)
        for j in range(n):
            p = self._unit(first_sample + j)
            at = 0
            for d in self._order[self._pack_first[p] : self._pack_first[p + 1]]:
                sh = self.data.shards[int(self._shard[d])]
                s = int(self._starts[d])
                e = min(int(self._ends[d]), s + L + 1)
                toks = np.asarray(sh.tokens[s:e], dtype=np.int64)
                keep = np.asarray(sh.mask[s + 1 : e], dtype=bool)
                k = len(toks) - 1
                inputs[j, at : at + k] = toks[:-1]
                labels[j, at : at + k] = np.where(keep, toks[1:], IGNORE_INDEX)
                pos[j, at : at + k] = np.arange(k)
                at += k
            if at < L:
                pos[j, at:] = np.arange(L - at)
            filled[j] = at
        real = int(filled.sum())
        if self.packing == "pad":  # one sample a row: no wider than the longest needs
            w = pad_width(int(filled.max()), L)
            return Batch(inputs[:, :w], labels[:, :w], pos[:, :w], real)
        return Batch(inputs, labels, pos, real)


class Mixture:
    """Samples drawn from several sources by weight, as a pure function of (seed, global sample number).

    Sample numbers are cut into blocks of BLOCK; in every block each source gets its share of the
    slots (largest remainder, so the shares are exact per block) and the slots are shuffled by a
    generator seeded with (seed, block). Sample g is then source i's sample number
    (block x slots_i + its rank among the block's slots of source i), read through that source's own
    Sampler: no state to save, so resume stays exact, and each source runs through its own epochs.
    """

    BLOCK = MIXTURE_BLOCK

    def __init__(self, samplers: list[Sampler], weights: list[float], seed: int):
        self.samplers, self.seed = samplers, seed
        w = np.asarray(weights, dtype=np.float64)
        share = w / w.sum() * self.BLOCK
        n = np.floor(share).astype(np.int64)
        rest = self.BLOCK - int(n.sum())
        n[np.argsort(-(share - n), kind="stable")[:rest]] += 1
        self.per_block = n
        self.data = samplers[0].data
        self.chat = samplers[0].chat
        self._block, self._src, self._idx = -1, np.empty(0, np.int64), np.empty(0, np.int64)

    @property
    def truncated(self) -> int:
        return sum(s.truncated for s in self.samplers)

    def describe(self) -> str:
        parts = [
            f"{s.data.source} x{int(k)}/{self.BLOCK}"
            for s, k in zip(self.samplers, self.per_block, strict=True)
        ]
        return "mixture of " + ", ".join(parts)

    def _slots(self, block: int) -> None:
        if block == self._block:
            return
        src = np.repeat(np.arange(len(self.samplers)), self.per_block)
        src = src[np.random.default_rng([self.seed, 0x313C, block]).permutation(self.BLOCK)]
        idx = np.empty(self.BLOCK, dtype=np.int64)
        for i in range(len(self.samplers)):
            at = np.flatnonzero(src == i)
            idx[at] = block * self.per_block[i] + np.arange(len(at))
        self._block, self._src, self._idx = block, src, idx

    def source_of(self, g: int) -> tuple[int, int]:
        """(source, that source's own sample number) of global sample g."""
        block, j = divmod(g, self.BLOCK)
        self._slots(block)
        return int(self._src[j]), int(self._idx[j])

    def get(self, first_sample: int, n: int) -> Batch:
        rows = []
        for g in range(first_sample, first_sample + n):
            i, k = self.source_of(g)
            rows.append(self.samplers[i].get(k, 1))
        width = max(r.input_ids.shape[1] for r in rows)
        rows = [_widen(r, width, self.data.eos_id) for r in rows]
        pos = None if rows[0].position_ids is None else np.concatenate([r.position_ids for r in rows])
        return Batch(
            np.concatenate([r.input_ids for r in rows]),
            np.concatenate([r.labels for r in rows]),
            pos,
            sum(r.real_tokens for r in rows),
        )


def _widen(b: Batch, width: int, eos_id: int) -> Batch:
    """`pad` rows of different sources, padded to the widest (a run of positions of its own, no labels)."""
    extra = width - b.input_ids.shape[1]
    if not extra:
        return b
    n = b.input_ids.shape[0]
    pos = b.position_ids
    if pos is not None:
        pos = np.concatenate([pos, np.tile(np.arange(extra, dtype=np.int64), (n, 1))], axis=1)
    return Batch(
        np.concatenate([b.input_ids, np.full((n, extra), eos_id, dtype=np.int64)], axis=1),
        np.concatenate([b.labels, np.full((n, extra), IGNORE_INDEX, dtype=np.int64)], axis=1),
        pos,
        b.real_tokens,
    )


def sample_index(step: int, micro: int, rank: int, *, grad_accum: int, world: int, micro_batch: int) -> int:
    """Global number of the first sample of (optimizer step, micro step, rank)."""
    return ((step * grad_accum + micro) * world + rank) * micro_batch


@dataclass(frozen=True)
class DataPosition:
    """Where each step's samples begin: `samples` consumed by the end of step `step`, then `batch` per
    step (Megatron's consumed_samples). A resume at another global batch (the default rounds it to
    the world size, so another node count may change it) continues at the next unseen sample: none
    skipped, none repeated. An uninterrupted run's is (0, 0, batch), which is `sample_index`."""

    step: int
    samples: int
    batch: int

    def first(self, step: int) -> int:
        """Samples consumed before `step` (0-based) begins."""
        return self.samples + (step - self.step) * self.batch

    def micro_batch_start(
        self, step: int, micro: int, rank: int, *, grad_accum: int, world: int, micro_batch: int
    ) -> int:
        """Global number of the first sample of (optimizer step, micro step, rank): the step's start,
        then `sample_index`'s order within the step."""
        within = sample_index(0, micro, rank, grad_accum=grad_accum, world=world, micro_batch=micro_batch)
        return self.first(step) + within
