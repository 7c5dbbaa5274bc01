"""Turns a batch of next-token logits into next tokens (and logprobs), one row per sequence.

Order of operations per row, as in vLLM:
  1. logprobs are taken from the raw logits (log_softmax before any processing);
  2. penalties: repetition over prompt + output tokens, presence/frequency over output tokens;
  3. min_tokens: while the output is shorter, stop_token_ids and EOS are masked to -inf. With
     `ignore_eos`, EOS is an ordinary token (vLLM leaves it out of the stop set), so it is not
     masked;
  4. greedy rows take the argmax; sampled rows are divided by their temperature, then top-k,
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
from dataclasses import dataclass
from itertools import chain

import torch

from engine_service.model.sampling_params import SamplingParams

# Candidates for top-p rows without top-k, widened in these steps (then the whole vocabulary)
# while a row's nucleus does not fit. A trained LM's top-p 0.9 nucleus is usually far smaller
# than 64 tokens. CPU cost per row of 49152 logits: topk(64) ~0.05 ms, topk(1024) ~0.3 ms,
# topk(8192) ~1 ms, a full sort ~5 ms.
NUCLEUS_CANDIDATES = (64, 1024, 8192)
_CDF_BLOCK = 256  # entries per block of the two-level inverse-CDF draw


@dataclass(slots=True)
class SamplingRow:
    """One sequence to sample a next token for, in batch order."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Per-sequence generator when params.seed is set; None: the sampler's shared one.
    generator: torch.Generator | None = None


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, under the model's raw distribution
    top: dict[int, float]  # the `params.logprobs` most likely tokens -> logprob, plus the sampled
    rank: int = 1  # 1 + how many tokens are strictly more likely than the sampled one


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


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
    last entry with weight."""
    cdf = weights.cumsum(dim=-1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    off_end = (index >= weights.shape[1]).nonzero().flatten()
    if len(off_end):
        positive = weights[off_end] > 0
        index[off_end] = weights.shape[1] - 1 - positive.flip(-1).int().argmax(dim=-1)
    if not with_below:
        return index
    before = cdf.gather(1, (index - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    return index, torch.where(index > 0, before, torch.zeros_like(before))


def _flat_positions(
    lists: list[list[int]], rows: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """Positions `row * vocab + token` in a flattened [rows, vocab] tensor, for every token of
    every list (list k belongs to row rows[k]); repeats kept."""
    lengths = torch.tensor([len(t) for t in lists], device=device)
    starts = torch.repeat_interleave(torch.tensor(rows, device=device) * vocab, lengths)
    tokens = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long, device=device)
    return starts + tokens


def _select_rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """t[idx] along dim 0; t itself when idx is every row (index_select beats t[list] ~3x)."""
    if len(idx) == t.shape[0]:
        return t
    return t.index_select(0, torch.tensor(idx, device=t.device))


def _min_tokens_active(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

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
        want_logprobs = any(r.params.logprobs is not None for r in rows)

        penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
        min_tokens = [i for i, r in enumerate(rows) if _min_tokens_active(r)]
        if not penalized and not min_tokens and all(r.params.is_greedy for r in rows):
            token_ids = raw.argmax(dim=-1)  # the common fast path: one argmax, no copy
        elif not penalized and not min_tokens:
            token_ids = self._choose(raw, rows)  # nothing modifies the logits in place
        else:
            # Never modify the caller's logits (raw logprobs need them); contiguous for view(-1).
            processed = raw.clone(memory_format=torch.contiguous_format)
            if penalized:
                self._apply_penalties(processed, rows, penalized)
            if min_tokens:
                self._mask_stop_tokens(processed, rows, min_tokens)
            token_ids = self._choose(processed, rows)

        token_list = token_ids.tolist()
        if not want_logprobs:
            return SamplerOutput(token_ids=token_list, logprobs=[None] * len(rows))
        return SamplerOutput(token_ids=token_list, logprobs=self._logprobs(raw, rows, token_ids))

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]):
        """vLLM's penalties, touching only the logits of tokens that occur (sparse, in place):
        repetition over prompt + output tokens, then frequency (x count) and presence over
        output tokens."""
        device, vocab = logits.device, logits.shape[1]
        flat = logits.view(-1)  # processed logits are a fresh contiguous clone
        per_row = [[1.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows)]
        for i in idx:
            p = rows[i].params
            per_row[0][i] = p.repetition_penalty
            per_row[1][i] = p.frequency_penalty
            per_row[2][i] = p.presence_penalty
        repetition, frequency, presence = torch.tensor(per_row, device=device)
        outputs = _flat_positions([rows[i].output_token_ids for i in idx], idx, vocab, device)
        in_output, counts = torch.unique(outputs, return_counts=True)

        if any(rows[i].params.repetition_penalty != 1.0 for i in idx):
            prompts = _flat_positions([rows[i].prompt_token_ids for i in idx], idx, vocab, device)
            seen = torch.unique(torch.cat([prompts, in_output]))
            values = flat[seen]
            factor = repetition[seen // vocab]
            # Positive logits shrink, negative ones grow: both make the token less likely.
            flat[seen] = torch.where(values > 0, values / factor, values * factor)
        owner = in_output // vocab
        flat[in_output] -= frequency[owner] * counts + presence[owner]

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

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if greedy:
            token_ids[greedy] = _select_rows(logits, greedy).argmax(dim=-1)
        if sampled:
            sampled_logits = _select_rows(logits, sampled)
            token_ids[sampled] = self._sample(sampled_logits, [rows[i] for i in sampled])
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab, device = logits.shape[1], logits.device
        # Temperature is applied late, to the few values that need it: top-k candidates are
        # the same before and after dividing by a positive number.
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        # One uniform per row, drawn up front so that no later widening of the candidates can
        # change how many a seeded row consumes.
        uniform = torch.empty(len(rows), device=device)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if shared:
            generator = self.shared_generator(device)
            uniform[shared] = torch.rand(len(shared), device=device, generator=generator)
        for j, r in enumerate(rows):
            if r.generator is not None:
                uniform[j] = torch.rand(1, device=device, generator=r.generator)[0]

        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
        ranked = [j for j, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1]
        if len(ranked) < len(rows):
            full = [j for j, r in enumerate(rows) if not (r.params.top_k > 0 or r.params.top_p < 1)]
            token_ids[full] = self._sample_full(
                _select_rows(logits, full),
                [rows[j] for j in full],
                temperature[full],
                uniform[full],
            )
        widths = [*NUCLEUS_CANDIDATES, vocab]
        for attempt, nucleus_width in enumerate(widths):
            if not ranked:
                break
            top_ks = [rows[j].params.top_k for j in ranked]
            width = min(vocab, max(k if k > 0 else nucleus_width for k in top_ks))
            chosen, overflow = self._sample_ranked(
                _select_rows(logits, ranked),
                [rows[j] for j in ranked],
                width,
                temperature[ranked],
                uniform[ranked],
            )
            token_ids[ranked] = chosen
            # Nuclei wider than the candidates: redo those rows with more.
            ranked = [ranked[k] for k in overflow] if attempt + 1 < len(widths) else []
        return token_ids

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
    ) -> tuple[torch.Tensor, list[int]]:
        """Top-k / top-p / min-p over the `width` best candidates of each row.

        Returns the tokens and the positions of rows whose top-p nucleus did not fit in
        `width` candidates (their token is not valid; redo them with more).
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

        overflow: list[int] = []
        if width < vocab and no_top_k:
            # Every candidate kept and still short of top_p: the nucleus may be wider.
            short = keep[:, -1] & (cumulative[:, -1] < top_p * total)
            short[[k for k, r in enumerate(rows) if r.params.top_k > 0]] = False
            overflow = short.nonzero().flatten().tolist()

        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            log_min_p = torch.tensor(min_p, device=device).log().unsqueeze(1)
            keep &= values >= best + log_min_p
        choice = _inverse_cdf(weights.masked_fill_(~keep, 0.0), uniform)
        return token_idx.gather(1, choice.unsqueeze(1)).squeeze(1), overflow

    def _logprobs(
        self, raw: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        token_list = token_ids.tolist()
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs = _select_rows(raw, wanted).log_softmax(dim=-1)
        chosen = token_ids[wanted].unsqueeze(1)
        chosen_lp = logprobs.gather(1, chosen)
        ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
        chosen_list = chosen_lp.squeeze(1).tolist()
        num_top = max(rows[i].params.logprobs for i in wanted)
        top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
        top_values_list = top_values.tolist() if top_values is not None else None
        top_ids_list = top_ids.tolist() if top_ids is not None else None

        result: list[TokenLogprobs | None] = [None] * len(rows)
        for k, i in enumerate(wanted):
            n = rows[i].params.logprobs
            token = token_list[i]
            top = {}
            if n and top_ids_list is not None and top_values_list is not None:
                top = dict(zip(top_ids_list[k][:n], top_values_list[k][:n], strict=True))
            top[token] = chosen_list[k]
            result[i] = TokenLogprobs(token, chosen_list[k], top, ranks[k])
        return result
