"""Turns a batch of next-token logits into next tokens (and logprobs), one row per sequence.

Order of operations per row, as in vLLM:
  1. logprobs are taken from the raw logits (log_softmax before any processing);
  2. logit_bias: each row's biases added to its tokens' logits (OpenAI's logit_bias; vLLM
     applies it among its logits processors, before the penalties);
  3. penalties: repetition over prompt + output tokens, presence/frequency over output tokens
     (from per-sequence counts kept on the device and updated with each sampled token,
     `TokenCounts`: a step never rebuilds them from the token lists);
  4. allowed_token_ids: every other token of the row masked to -inf (vLLM's); bad_words: the
     token that would complete one after the output so far masked to -inf (vLLM's);
  5. structured outputs: a constrained row's tokens are masked to -inf unless its grammar
     allows them next (its matcher's bitmask, model/grammar.py);
  6. min_tokens: while the output is shorter, stop_token_ids and EOS are masked to -inf. With
     `ignore_eos`, EOS is an ordinary token (vLLM leaves it out of the stop set), so it is not
     masked. Where a grammar, or allowed_token_ids, allows nothing but stop tokens, it wins:
     the output ends there, however short;
  7. greedy rows take the argmax; sampled rows are divided by their temperature, then top-k,
     top-p (on the top-k-renormalized distribution) and min-p (relative to the most likely
     token) are applied, and a token is drawn.

Everything is vectorized across rows. A draw is an inverse-CDF lookup (cumsum, then
searchsorted of one uniform per row): one random number per row and step, not one per token.
Top-k and top-p work on the `torch.topk` candidates (the kept set is always a prefix of them),
never on a sort of the whole vocabulary; only a row whose top-p nucleus does not fit in them is
redone with more candidates, and at worst the whole vocabulary. A row with its own generator (a
seeded request) takes exactly one uniform from it per step, and the candidates' order does not
depend on how many there are, so its tokens depend only on its logits and its generator: never
on the rest of the batch or on which path was taken.
"""

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_service.model.bad_words import WordIndex, banned_next, word_index
from engine_service.model.sampling_params import SamplingParams
from engine_service.model.token_logprobs import TokenLogprobs

# Candidates for top-p rows without top-k, widened in these steps (then the whole vocabulary)
# while a row's nucleus does not fit. A trained LM's top-p 0.9 nucleus is usually far smaller
# than 64 tokens. CPU cost per row of 49152 logits: topk(64) ~0.05 ms, topk(1024) ~0.3 ms,
# topk(8192) ~1 ms, a full sort ~5 ms.
NUCLEUS_CANDIDATES = (64, 1024, 8192)
_CDF_BLOCK = 256  # entries per block of the two-level inverse-CDF draw


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample a next token for, in batch order.

    The token sequences are read for their length (min_tokens) every step, and for their
    contents only where a penalized row has no `penalty_slot` (a row of the sampler's
    `token_counts`, kept up to date with every token it samples for the row): the engine
    passes views of its sequences (O(1)) and a slot, so a step costs the same at any length.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-sequence generator when params.seed is set; None: the sampler's shared one.
    generator: torch.Generator | None = None
    penalty_slot: int | None = None
    # params.logit_bias as (token ids, biases) on the sampling device, made at the row's first
    # biased step: the row lives as long as its sequence, so a step reuses them.
    bias: tuple[torch.Tensor, torch.Tensor] | None = None
    # The sequence's xgrammar matcher (structured outputs): which tokens may come next. The
    # engine advances it with each token it appends.
    matcher: object | None = None
    # params.allowed_token_ids on the sampling device, and whether each of them stops the
    # output (then min_tokens holds none back): made at the row's first step, as `bias`.
    allowed: tuple[torch.Tensor, bool] | None = None
    # params.bad_words_token_ids indexed for a step's reading (bad_words.word_index), made at
    # the row's first step
    bad_words: WordIndex | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None



def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first highest-scoring token, as argmax gives it: torch's CPU max(dim) finds
    it 3-5x faster than its argmax (32 rows x 49152 float32, one thread: 0.75 vs 2.06 ms, a
    twentieth of a bf16 decode step of 32 sequences)."""
    return logits.max(dim=-1).indices

def make_generator(seed: int, sequence_index: int, device: torch.device | str) -> torch.Generator:
    """Deterministic generator for sequence `sequence_index` of a request with this seed.

    Seed and index are hashed together (not added), so (seed 1, index 1) and (seed 2, index 0)
    do not share a stream.
    """
    key = seed.to_bytes(16, "little", signed=True) + sequence_index.to_bytes(8, "little")
    derived = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(derived)
    return generator


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index drawn per row with probability proportional to `weights` (>= 0, rows not all 0).

    Wide rows go in two levels (block sums, then a cumsum inside the chosen block only): a
    cumsum over the whole vocabulary is the slowest op of a draw on CPU.
    """
    num_rows, width = weights.shape
    if width <= 4 * _CDF_BLOCK:
        return _searchsorted_positive(weights, uniform.unsqueeze(1) * weights.sum(-1, True))
    num_blocks = -(-width // _CDF_BLOCK)
    padded = torch.nn.functional.pad(weights, (0, num_blocks * _CDF_BLOCK - width))
    blocks = padded.view(num_rows, num_blocks, _CDF_BLOCK)
    block_weights = blocks.sum(dim=-1)
    target = uniform.unsqueeze(1) * block_weights.sum(dim=-1, keepdim=True)
    block, below = _searchsorted_positive(block_weights, target, with_below=True)
    inner = blocks[torch.arange(num_rows, device=weights.device), block]
    return block * _CDF_BLOCK + _searchsorted_positive(inner, target - below.unsqueeze(1))


def _searchsorted_positive(weights: torch.Tensor, target: torch.Tensor, with_below=False):
    """First index whose cumulative weight exceeds `target` [rows, 1], and optionally the
    cumulative weight before it. right=True never lands on a zero-weight entry (its cdf
    equals its left neighbour's); only rounding can run off the end, and such a row takes its
    last entry with weight. That fallback is computed for every row: picking out the rows
    that need it would wait for the device (nonzero)."""
    cdf = weights.cumsum(dim=-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    width = weights.shape[1]
    last_positive = width - 1 - (weights > 0).flip(-1).int().argmax(dim=-1)
    index = torch.where(index >= width, last_positive, index)
    if not with_below:
        return index
    before = cdf.gather(1, (index - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    return index, torch.where(index > 0, before, torch.zeros_like(before))


class TokenCounts:
    """Per-sequence token statistics for the penalties, one row per sequence, on the sampling
    device: how often each token occurs in the output (`counts`, float: it multiplies the
    frequency penalty) and whether it occurs in the prompt or the output (`seen`, for the
    repetition penalty). A row is built from the sequence's tokens once (`add`), then every
    sampled token is added on the device (`record`), so a penalized step reads its rows with
    one gather instead of rebuilding them from Python lists (which grew with the output).

    Rows are reused after `release`; the tensors grow by doubling to the most penalized
    sequences alive at once (each row is vocab x 5 bytes: 640 KiB for a 128k vocabulary).
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, device=self.device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._free: list[int] = []
        self._one = torch.ones(1, device=self.device)

    @property
    def num_held(self) -> int:
        return self.counts.shape[0] - len(self._free)

    def add(self, sequences: list[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
        """Rows for sequences with these (prompt, output) tokens: O(tokens), once per sequence,
        in one upload for all of them."""
        while len(self._free) < len(sequences):
            self._grow()
        slots = [self._free.pop() for _ in sequences]
        row_of_token: list[int] = []
        tokens: list[int] = []
        is_output: list[int] = []
        for slot, (prompt, output) in zip(slots, sequences, strict=True):
            row_of_token += [slot] * (len(prompt) + len(output))
            tokens += prompt
            tokens += output
            is_output += [0] * len(prompt) + [1] * len(output)
        num = len(tokens)
        upload = torch.tensor(slots + row_of_token + tokens + is_output, dtype=torch.long,
                              device=self.device)
        new_rows = upload[: len(slots)]
        rows, ids, weights = upload[len(slots):].view(3, num)
        self.counts[new_rows] = 0.0
        self.seen[new_rows] = False
        # Prompt tokens add 0 (a mask would make the host wait for the device).
        self.counts.index_put_((rows, ids), weights.float(), accumulate=True)
        self.seen[rows, ids] = True
        return slots

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """counts and seen of these rows, [len(slots), vocab] each (copies)."""
        return self.counts.index_select(0, slots), self.seen.index_select(0, slots)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """token_ids[i] was sampled for row slots[i] (distinct rows): on the device, no wait."""
        self.counts.index_put_((slots, token_ids), self._one.expand(len(slots)),
                               accumulate=True)
        self.seen[slots, token_ids] = True

    def _grow(self) -> None:
        held = self.counts.shape[0]
        size = max(8, 2 * held)
        for name in ("counts", "seen"):
            old = getattr(self, name)
            new = old.new_zeros((size, self.vocab_size))
            new[:held] = old
            setattr(self, name, new)
        self._free.extend(range(size - 1, held - 1, -1))  # the lowest row is handed out first


def _select_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """t[idx] along dim 0; t itself when idx is every row (index_select beats t[list] ~3x)."""
    if len(idx) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(idx, device=t.device))


def _add_logit_bias(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Rows idx's logit_bias added to their logits, in place: each row's ids and biases are
    uploaded once (SamplingRow.bias); a step concatenates them and adds with one gather and
    one scatter (a row's ids are distinct: no accumulation needed)."""
    device = logits.device
    ids, biases, counts = [], [], []
    for i in idx:
        row = rows[i]
        if row.bias is None:
            bias = row.params.logit_bias
            row.bias = (torch.tensor(list(bias), dtype=torch.long, device=device),
                        torch.tensor(list(bias.values()), dtype=logits.dtype, device=device))
        ids.append(row.bias[0])
        biases.append(row.bias[1])
        counts.append(len(row.bias[0]))
    columns = torch.cat(ids)
    row_of = torch.repeat_interleave(torch.tensor(idx, device=device),
                                     torch.tensor(counts, device=device))
    logits.index_put_((row_of, columns), logits[row_of, columns] + torch.cat(biases))


def _mask_bad_words(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Rows idx's bad words cut at their last token, in place: each token that would complete
    one after the row's output so far is masked (a one-token word always)."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i in idx:
        row = rows[i]
        if row.bad_words is None:
            row.bad_words = word_index(row.params.bad_words_token_ids)
        banned = banned_next(row.bad_words, row.output_token_ids)
        row_idx += [i] * len(banned)
        col_idx += banned
    if col_idx:
        logits[row_idx, col_idx] = -math.inf


def _min_tokens_active(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        # Penalty statistics of the sequences that use penalties (SamplingRow.penalty_slot).
        self.token_counts = TokenCounts(vocab_size, device)

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator of rows without their own (one per device, created on first use)."""
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared_generators[device] = generator
        return generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns, fewer than vocab size {self.vocab_size}"
            )
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        # Models often pad the embedding past the tokenizer's vocab: those columns are no tokens.
        raw = logits[:, : self.vocab_size].float()
        # One pass over the rows (the host's share of a step is per row).
        want_logprobs, all_greedy = False, True
        penalized: list[int] = []
        min_tokens: list[int] = []
        biased: list[int] = []
        restricted: list[int] = []
        worded: list[int] = []
        constrained: list[int] = []
        for i, r in enumerate(rows):
            params = r.params
            if params.logprobs is not None:
                want_logprobs = True
            if params.logit_bias:
                biased.append(i)
            if params.allowed_token_ids is not None:
                restricted.append(i)
            if params.bad_words_token_ids:
                worded.append(i)
            if r.matcher is not None:
                constrained.append(i)
            if params.has_penalties:
                penalized.append(i)
            if params.min_tokens and _min_tokens_active(r):
                min_tokens.append(i)
            if not params.is_greedy:
                all_greedy = False
        slots = None
        if penalized or min_tokens or biased or restricted or worded or constrained:
            # Never modify the caller's logits (raw logprobs need them); contiguous for view(-1).
            processed = raw.clone(memory_format=torch.contiguous_format)
            if biased:
                _add_logit_bias(processed, rows, biased)
            if penalized:
                slots = self._penalty_slots(rows, penalized)
                self._apply_penalties(processed, rows, penalized, slots[0])
            if restricted:
                min_tokens = self._mask_to_allowed(processed, rows, restricted, min_tokens)
            if worded:
                _mask_bad_words(processed, rows, worded)
            if constrained:
                min_tokens = self._mask_to_grammar(processed, rows, constrained, min_tokens)
            if min_tokens:
                self._mask_stop_tokens(processed, rows, min_tokens)
        else:
            processed = raw  # nothing modifies the logits in place
        try:
            return self._pick(raw, processed, rows, want_logprobs, all_greedy, penalized, slots)
        finally:
            if slots is not None:
                for slot in slots[1]:
                    self.token_counts.release(slot)

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Next tokens for rows that are all greedy with nothing to apply (no penalties,
        logprobs or active min_tokens): the tokens __call__ picks for them, without a
        SamplingRow per row."""
        if logits.dim() != 2 or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits must be [rows, vocab >= {self.vocab_size}], got "
                             f"{tuple(logits.shape)}")
        return _greedy(logits[:, : self.vocab_size].float()).tolist()

    def _penalty_slots(self, rows: list[SamplingRow], idx: list[int]
                       ) -> tuple[torch.Tensor, list[int]]:
        """The token_counts rows of the penalized rows idx (on the device), and the rows made
        for this call only (rows without a slot of their own, built from their tokens)."""
        untracked = [i for i in idx if rows[i].penalty_slot is None]
        temporary = self.token_counts.add(
            [(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in untracked]
        ) if untracked else []
        made = dict(zip(untracked, temporary, strict=True))
        slots = [made[i] if rows[i].penalty_slot is None else rows[i].penalty_slot for i in idx]
        device = self.token_counts.device
        return torch.tensor(slots, dtype=torch.long, device=device), temporary

    def _pick(self, raw: torch.Tensor, processed: torch.Tensor, rows: list[SamplingRow],
              want_logprobs: bool, all_greedy: bool, penalized: list[int],
              slots: tuple[torch.Tensor, list[int]] | None) -> SamplerOutput:
        draw = None
        if all_greedy:
            token_ids = _greedy(processed)  # the common fast path: one reduction
        else:
            draw = self._choose(processed, rows)
            token_ids = draw.token_ids

        # Everything the host needs from this step comes back in one transfer (one wait for
        # the device): the tokens, whether any top-p nucleus overflowed its candidates, and
        # the logprobs asked for.
        while True:
            parts = [token_ids]
            if draw is not None:
                parts.append(draw.overflow)
            lp_parts = self._logprob_tensors(raw, rows, token_ids) if want_logprobs else None
            if lp_parts is not None:
                parts += lp_parts.flat()
            n = len(rows)
            if len(parts) == 1:  # tokens alone: as ints, no float round trip
                host = token_list = token_ids.tolist()
            else:
                host = torch.cat([t.reshape(-1).double() for t in parts]).tolist()
                token_list = [int(t) for t in host[:n]]
            offset = n
            if draw is not None:
                redo = [i for i, flag in enumerate(host[n : 2 * n]) if flag]
                offset = 2 * n
                if redo:  # rare: redone with more candidates (costs more transfers)
                    token_ids = self._widen(draw, redo)
                    draw = None
                    continue
            break
        if slots is not None:  # the penalty counts follow the sampled tokens, on the device
            chosen = token_ids if len(penalized) == len(rows) else _select_rows(token_ids,
                                                                                penalized)
            self.token_counts.record(slots[0], chosen)
        if lp_parts is None:
            return SamplerOutput(token_ids=token_list, logprobs=[None] * len(rows))
        return SamplerOutput(
            token_ids=token_list, logprobs=lp_parts.unpack(host[offset:], rows, token_list)
        )

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int],
                         slots: torch.Tensor):
        """vLLM's penalties, in place on rows idx (whose token_counts rows are `slots`):
        repetition over prompt + output tokens, then frequency (x count) and presence over
        output tokens. Dense over the vocabulary (an untouched token gets exactly its own
        logit back), so nothing waits for the device."""
        device = logits.device
        params = [rows[i].params for i in idx]
        repetition, frequency, presence = torch.tensor(
            [[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
             [p.presence_penalty for p in params]], device=device,
        ).unsqueeze(-1)
        selected = _select_rows(logits, idx)
        out_counts, seen = self.token_counts.rows(slots)
        in_output = out_counts > 0
        if any(p.repetition_penalty != 1.0 for p in params):
            # Positive logits shrink, negative ones grow: both make the token less likely.
            penalized = torch.where(selected > 0, selected / repetition, selected * repetition)
            selected = torch.where(seen, penalized, selected)
        selected = selected - (frequency * out_counts + presence * in_output)
        if len(idx) == logits.shape[0]:
            logits.copy_(selected)
        else:
            logits.index_copy_(0, torch.tensor(idx, device=device), selected)

    def _mask_to_grammar(self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int],
                         min_tokens: list[int]) -> list[int]:
        """Rows idx masked to what their grammars allow next, in place. Their min_tokens
        stops are masked here too, in the bitmask, unless the grammar allows nothing else (an
        empty row has no token to draw). Returns the min_tokens rows still to mask.

        The bitmask (a bit per token, filled by each matcher on the host) becomes a bool per
        token with numpy's unpackbits and masks with one torch.where: 5-7x faster on the CPU
        than xgrammar's own kernel (16 rows of 49,152 tokens, mostly masked: 0.7-1.1 ms
        against 5.0-5.3)."""
        vocab = self.vocab_size
        words = -(-vocab // 32)
        bitmask = torch.empty(len(idx), words, dtype=torch.int32)
        short = set(min_tokens)
        for k, i in enumerate(idx):
            rows[i].matcher.fill_next_token_bitmask(bitmask, k)
            if i in short:
                self._forbid_stops(bitmask[k], rows[i].params)
        # Bit j of word w is token 32 w + j (little-endian words, little bit order).
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool).view(len(idx), words * 32)[:, :vocab]
        selected = _select_rows(logits, idx)
        masked = torch.where(allowed.to(logits.device), selected, -math.inf)
        if len(idx) == logits.shape[0]:
            logits.copy_(masked)
        else:
            logits.index_copy_(0, torch.tensor(idx, device=logits.device), masked)
        return [i for i in min_tokens if rows[i].matcher is None]

    def _mask_to_allowed(self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int],
                         min_tokens: list[int]) -> list[int]:
        """Rows idx masked to their allowed_token_ids, in place: their logits at those ids
        kept, the rows filled with -inf, the kept ones put back (one gather, fill and
        scatter for all rows). Returns the min_tokens rows still to mask: not those whose
        allowed tokens all stop the output (an empty row has no token to draw)."""
        device = logits.device
        columns, counts, only_stops = [], [], set()
        for i in idx:
            row = rows[i]
            if row.allowed is None:
                params = row.params
                row.allowed = (torch.tensor(params.allowed_token_ids, dtype=torch.long,
                                            device=device),
                               params.only_stops_allowed(self.eos_token_ids))
            columns.append(row.allowed[0])
            counts.append(len(row.allowed[0]))
            if row.allowed[1]:
                only_stops.add(i)
        cols = torch.cat(columns)
        row_index = torch.tensor(idx, device=device)
        row_of = torch.repeat_interleave(row_index, torch.tensor(counts, device=device))
        kept = logits[row_of, cols]
        logits.index_fill_(0, row_index, -math.inf)
        logits.index_put_((row_of, cols), kept)
        return [i for i in min_tokens if i not in only_stops]

    def _forbid_stops(self, allowed: torch.Tensor, params: SamplingParams) -> None:
        """Clears the stop tokens' bits of one bitmask row, unless no other bit is set. One
        vectorized pass over the stops (a loop over them took 1.7 ms a row with 256)."""
        stops = np.fromiter(self.eos_token_ids.union(params.stop_token_ids), dtype=np.int64)
        stops = stops[stops < self.vocab_size]
        words = allowed.numpy().view(np.uint32)
        stop_bits = np.zeros_like(words)
        np.bitwise_or.at(stop_bits, stops >> 5, np.left_shift(1, stops & 31).astype(np.uint32))
        kept = words & ~stop_bits
        if kept.any():
            words[:] = kept

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]):
        vocab = logits.shape[1]
        row_idx: list[int] = []
        col_idx: list[int] = []
        for i in idx:
            params = rows[i].params
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= self.eos_token_ids
            cols = [t for t in stops if t < vocab]
            row_idx += [i] * len(cols)
            col_idx += cols
        if col_idx:
            logits[row_idx, col_idx] = -math.inf

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> "_Draw":
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        overflow = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            token_ids[greedy] = _greedy(_select_rows(logits, greedy))
        draw = _Draw(token_ids, overflow, logits, rows, None, None)
        if sampled:
            self._sample(draw, sampled)
        return draw

    def _sample(self, draw: "_Draw", sampled: list[int]) -> None:
        """Draw tokens for rows `sampled` of the batch into draw.token_ids. Rows whose top-p
        nucleus may be wider than the first candidates are flagged in draw.overflow (their
        token is not valid) for `_widen`: deciding here would wait for the device."""
        logits = draw.logits
        rows = draw.rows
        device = logits.device
        # Temperature is applied late, to the few values that need it: top-k candidates are
        # the same before and after dividing by a positive number.
        temperature = torch.zeros(len(rows), device=device)
        temperature[sampled] = torch.tensor(
            [rows[j].params.temperature for j in sampled], device=device
        )
        # One uniform per row, drawn up front so that no later widening of the candidates can
        # change how many a seeded row consumes.
        uniform = torch.zeros(len(rows), device=device)
        shared = [j for j in sampled if rows[j].generator is None]
        if shared:
            generator = self.shared_generator(device)
            uniform[shared] = torch.rand(len(shared), device=device, generator=generator)
        for j in sampled:
            if rows[j].generator is not None:
                uniform[j] = torch.rand(1, device=device, generator=rows[j].generator)[0]
        draw.temperature, draw.uniform = temperature, uniform

        ranked = [j for j in sampled if rows[j].params.top_k > 0 or rows[j].params.top_p < 1]
        full = [j for j in sampled if not (rows[j].params.top_k > 0 or rows[j].params.top_p < 1)]
        if full:
            draw.token_ids[full] = self._sample_full(
                _select_rows(logits, full), [rows[j] for j in full], temperature[full],
                uniform[full],
            )
        if ranked:
            self._sample_ranked_rows(draw, ranked, NUCLEUS_CANDIDATES[0])

    def _sample_ranked_rows(self, draw: "_Draw", ranked: list[int], nucleus_width: int) -> None:
        rows, vocab = draw.rows, draw.logits.shape[1]
        top_ks = [rows[j].params.top_k for j in ranked]
        width = min(vocab, max(k if k > 0 else nucleus_width for k in top_ks))
        chosen, short = self._sample_ranked(
            _select_rows(draw.logits, ranked),
            [rows[j] for j in ranked],
            width,
            draw.temperature[ranked],
            draw.uniform[ranked],
        )
        draw.token_ids[ranked] = chosen
        draw.overflow[ranked] = short

    def _widen(self, draw: "_Draw", redo: list[int]) -> torch.Tensor:
        """Redo rows whose nucleus overflowed with more candidates, then the whole vocabulary
        (each widening waits for the device to learn which rows still overflow)."""
        vocab = draw.logits.shape[1]
        widths = [*NUCLEUS_CANDIDATES[1:], vocab]
        for attempt, nucleus_width in enumerate(widths):
            draw.overflow.zero_()
            self._sample_ranked_rows(draw, redo, nucleus_width)
            if attempt + 1 == len(widths):
                break
            flags = draw.overflow[redo].tolist()
            redo = [j for j, flag in zip(redo, flags, strict=True) if flag]
            if not redo:
                break
        return draw.token_ids

    def _sample_full(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        temperature: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Rows without top-k/top-p: min-p in vocabulary space, then a draw over all tokens."""
        num_rows, vocab = logits.shape
        # (logit - max) / T, written straight into a buffer padded to whole CDF blocks (zero
        # weight there: never drawn); three in-place passes, no temporaries.
        weights = torch.empty(num_rows, -(-vocab // _CDF_BLOCK) * _CDF_BLOCK, device=logits.device)
        weights[:, vocab:] = 0.0
        scaled = weights[:, :vocab]
        torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=scaled)
        scaled.div_(temperature.unsqueeze(1))
        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            # p >= min_p * p_max  <=>  scaled logit - scaled max >= log(min_p); log(0) = -inf.
            log_min_p = torch.tensor(min_p, device=logits.device).log().unsqueeze(1)
            scaled.masked_fill_(scaled < log_min_p, -math.inf)
        scaled.exp_()  # normalizing is left to the draw
        return _inverse_cdf(weights, uniform)

    def _sample_ranked(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        width: int,
        temperature: torch.Tensor,
        uniform: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k / top-p / min-p over the `width` best candidates of each row.

        Returns the tokens and a bool per row: True where the top-p nucleus did not fit in
        `width` candidates (that token is not valid; redo the row with more).
        """
        device, vocab = logits.device, logits.shape[1]
        values, token_idx = logits.topk(width, dim=-1)  # sorted, best first
        unscaled_best = values[:, :1]
        values = values / temperature.unsqueeze(1)
        top_k = torch.tensor(
            [min(r.params.top_k, width) if r.params.top_k > 0 else width for r in rows],
            device=device,
        )
        keep = torch.arange(width, device=device) < top_k.unsqueeze(1)

        # Probabilities (relative to the best candidate) renormalized over the top-k set when
        # there is one, over the whole vocabulary otherwise: what top-p is measured against.
        best = values[:, :1]
        weights = (values - best).exp_().masked_fill_(~keep, 0.0)
        total = weights.sum(dim=-1)
        no_top_k = [k for k, r in enumerate(rows) if r.params.top_k <= 0]
        if no_top_k:
            shifted = _select_rows(logits, no_top_k) - unscaled_best[no_top_k]
            total[no_top_k] = shifted.div_(temperature[no_top_k].unsqueeze(1)).exp_().sum(-1)
        cumulative = weights.cumsum(dim=-1)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        keep &= (cumulative - weights) < (top_p * total).unsqueeze(1)  # the best is always kept

        short = torch.zeros(len(rows), dtype=torch.bool, device=device)
        if width < vocab and no_top_k:
            # Every candidate kept and still short of top_p: the nucleus may be wider.
            short = keep[:, -1] & (cumulative[:, -1] < top_p * total)
            short[[k for k, r in enumerate(rows) if r.params.top_k > 0]] = False

        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            log_min_p = torch.tensor(min_p, device=device).log().unsqueeze(1)
            keep &= values >= best + log_min_p
        choice = _inverse_cdf(weights.masked_fill_(~keep, 0.0), uniform)
        return token_idx.gather(1, choice.unsqueeze(1)).squeeze(1), short

    def _logprob_tensors(
        self, raw: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
    ) -> "_LogprobTensors | None":
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return None
        logprobs = _select_rows(raw, wanted).log_softmax(dim=-1)
        chosen = _select_rows(token_ids, wanted).unsqueeze(1)
        chosen_lp = logprobs.gather(1, chosen).squeeze(1)
        ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
        num_top = max(rows[i].params.logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        return _LogprobTensors(wanted, chosen_lp, ranks, top_values, top_ids)


@dataclass(slots=True)
class _Draw:
    """A sampled batch in progress, kept so that overflowing rows can be redone."""

    token_ids: torch.Tensor  # [rows] long
    overflow: torch.Tensor  # [rows] bool: the row's top-p nucleus may exceed its candidates
    logits: torch.Tensor  # [rows, vocab] processed
    rows: list[SamplingRow]
    temperature: torch.Tensor | None  # [rows]
    uniform: torch.Tensor | None  # [rows], the one uniform each row uses this step


@dataclass(slots=True)
class _LogprobTensors:
    wanted: list[int]  # batch rows that asked for logprobs
    chosen: torch.Tensor  # [wanted] logprob of the sampled token
    ranks: torch.Tensor  # [wanted]
    top_values: torch.Tensor  # [wanted, num_top]
    top_ids: torch.Tensor  # [wanted, num_top]

    def flat(self) -> list[torch.Tensor]:
        return [self.chosen, self.ranks, self.top_values, self.top_ids]

    def unpack(
        self, host: list[float], rows: list[SamplingRow], token_list: list[int]
    ) -> list[TokenLogprobs | None]:
        """TokenLogprobs from the host copy of `flat()` (token ids and ranks are exact in
        float64)."""
        num_wanted, num_top = self.top_values.shape
        chosen = host[:num_wanted]
        ranks = host[num_wanted : 2 * num_wanted]
        values_at = 2 * num_wanted
        ids_at = values_at + num_wanted * num_top
        result: list[TokenLogprobs | None] = [None] * len(rows)
        for k, i in enumerate(self.wanted):
            n = rows[i].params.logprobs
            row_values = host[values_at + k * num_top : values_at + k * num_top + n]
            row_ids = host[ids_at + k * num_top : ids_at + k * num_top + n]
            top = {int(t): v for t, v in zip(row_ids, row_values, strict=True)}
            top[token_list[i]] = chosen[k]
            result[i] = TokenLogprobs(token_list[i], chosen[k], top, int(ranks[k]))
        return result
