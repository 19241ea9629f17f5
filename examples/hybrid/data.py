"""Synthetic token data: a fixed random Markov chain with variable sequence lengths.

Every sample is a function of (seed, step, global micro-batch index) alone, so

* any rank can rebuild any micro-batch (a middle stage needs only its shape, the first
  stage its tokens, the last stage its targets), with no data exchange;
* any split of the global batch over the DP replicas consumes the same samples;
* resuming from a checkpoint needs no data-loader state.

The chain has a few likely successors per token, so a small model's loss falls from
ln(vocab) towards the chain's entropy within a few dozen steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid.config import DataConfig

IGNORE_INDEX = -100
"""Target value of padding positions (skipped by the loss)."""

_LENGTHS_STREAM = 1
_TOKENS_STREAM = 2
_CHAIN_STREAM = 3
_NUM_SUCCESSORS = 3
_P_FOLLOW_CHAIN = 0.9


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch, right-padded to its longest sample.

    Shapes: ``tokens`` and ``targets`` (B, L) int64 with L = max(lengths); ``lengths`` (B,).
    Padding tokens are 0 and padding targets IGNORE_INDEX; with causal attention a real
    token never sees the padding to its right, so no attention mask is needed.
    """

    index: int
    """Global index in the step's batch."""
    lengths: np.ndarray
    tokens: np.ndarray | None
    targets: np.ndarray | None

    @property
    def seq_len(self) -> int:
        return int(self.lengths.max())

    @property
    def num_tokens(self) -> int:
        """Number of predicted tokens (loss terms)."""
        return int(self.lengths.sum())


class SyntheticData:
    """The job's data source; see the module doc."""

    def __init__(self, config: DataConfig, *, vocab_size: int, seed: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.seed = seed
        rng = np.random.default_rng([seed, _CHAIN_STREAM])
        self._successors = rng.integers(0, vocab_size, size=(vocab_size, _NUM_SUCCESSORS))

    def lengths(self, step: int, index: int) -> np.ndarray:
        """Sample lengths (B,) of micro-batch ``index`` of step ``step``."""
        c = self.config
        rng = np.random.default_rng([self.seed, _LENGTHS_STREAM, step, index])
        b = c.microbatch_size
        if c.seqlen_dist == "fixed":
            raw = np.full(b, c.seq_len)
        elif c.seqlen_dist == "uniform":
            raw = rng.integers(c.min_seq_len, c.seq_len + 1, size=b)
        elif c.seqlen_dist == "lognormal":
            raw = np.rint(rng.lognormal(np.log(max(c.seq_len / 4, 1)), c.seqlen_sigma, size=b))
        else:  # bimodal: mostly short samples, a few at full length
            short = rng.integers(c.min_seq_len, max(c.min_seq_len, c.seq_len // 4) + 1, size=b)
            raw = np.where(rng.random(b) < 0.1, c.seq_len, short)
        return np.clip(raw, c.min_seq_len, c.seq_len).astype(np.int64)

    def tokens_in_step(self, step: int, num_microbatches: int) -> int:
        """Predicted tokens in the whole global batch of step ``step`` (the loss's
        normaliser, the same on every rank)."""
        return int(sum(self.lengths(step, i).sum() for i in range(num_microbatches)))

    def microbatch(self, step: int, index: int, *, with_tokens: bool = True) -> MicroBatch:
        """Micro-batch ``index`` of step ``step``; ``with_tokens=False`` gives only its shape."""
        lengths = self.lengths(step, index)
        if not with_tokens:
            return MicroBatch(index=index, lengths=lengths, tokens=None, targets=None)
        b, width = lengths.size, int(lengths.max())
        rng = np.random.default_rng([self.seed, _TOKENS_STREAM, step, index])
        seq = np.empty((b, width + 1), dtype=np.int64)
        seq[:, 0] = rng.integers(0, self.vocab_size, size=b)
        follow = rng.random((b, width)) < _P_FOLLOW_CHAIN
        pick = rng.integers(0, _NUM_SUCCESSORS, size=(b, width))
        noise = rng.integers(0, self.vocab_size, size=(b, width))
        for t in range(width):
            nxt = self._successors[seq[:, t], pick[:, t]]
            seq[:, t + 1] = np.where(follow[:, t], nxt, noise[:, t])
        pad = np.arange(width)[None, :] >= lengths[:, None]
        tokens = np.where(pad, 0, seq[:, :-1])
        targets = np.where(pad, IGNORE_INDEX, seq[:, 1:])
        return MicroBatch(index=index, lengths=lengths, tokens=tokens, targets=targets)
