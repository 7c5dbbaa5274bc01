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

Everything is vectorized across rows. Draws use the Gumbel-max trick (argmax of logits plus
Gumbel noise), so a draw needs only uniform noise, never a sort of the whole vocabulary: top-k
and top-p work on the `torch.topk` candidates, and only a row whose top-p nucleus does not fit
in them falls back to a full sort. A row with its own generator (a seeded request) draws one
uniform per vocabulary entry every step, indexed by token id, so its tokens depend only on its
logits and its generator: never on the rest of the batch or on which path was taken.
"""

import hashlib
import math
from dataclasses import dataclass
from itertools import chain

import torch

from engine_service.sampling_params import SamplingParams

# Candidates kept for top-p rows without top-k; wider nuclei fall back to a full sort. Trained
# LMs put 0.9 of the mass in far fewer tokens; a full sort of 49k entries costs ~4 ms a row.
NUCLEUS_CANDIDATES = 256
_TINY = torch.finfo(torch.float32).tiny


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


def _gumbel(uniform: torch.Tensor) -> torch.Tensor:
    # -log(-log(u)) in place; u == 0 would give -inf (never drawn), clamp keeps it finite.
    return uniform.clamp_min_(_TINY).log_().neg_().log_().neg_()


def _flattened(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of every token of every list, for scatter/index_put."""
    lengths = torch.tensor([len(t) for t in lists], device=device)
    row_idx = torch.repeat_interleave(torch.arange(len(lists), device=device), lengths)
    tokens = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long, device=device)
    return row_idx, tokens


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
        else:
            processed = raw.clone()  # never modify the caller's logits (raw logprobs need them)
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
        device = logits.device
        params = [rows[i].params for i in idx]
        sub = logits[idx]
        # Count output tokens per row with one scatter over the flattened token lists.
        out_rows, out_tokens = _flattened([rows[i].output_token_ids for i in idx], device)
        counts = torch.zeros_like(sub)
        counts.index_put_(
            (out_rows, out_tokens), torch.ones_like(out_tokens, dtype=sub.dtype), accumulate=True
        )
        in_output = counts > 0

        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            seen = in_output.clone()
            seen[_flattened([rows[i].prompt_token_ids for i in idx], device)] = True
            factor = torch.tensor(repetition, device=device).unsqueeze(1)
            factor = torch.where(seen, factor, torch.ones((), device=device))
            # Positive logits shrink, negative ones grow: both make the token less likely.
            sub = torch.where(sub > 0, sub / factor, sub * factor)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device)
        sub -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output
        logits[idx] = sub

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
            token_ids[greedy] = logits[greedy].argmax(dim=-1)
        if sampled:
            token_ids[sampled] = self._sample(logits[sampled], [rows[i] for i in sampled])
        return token_ids

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab, device = logits.shape[1], logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        logits = logits.div_(temperature.unsqueeze(1))
        # Seeded rows: exactly `vocab` uniforms per step from their own generator, by token id,
        # drawn once here so that a fallback below cannot change how many a row consumes.
        own_noise = [
            None
            if r.generator is None
            else _gumbel(torch.rand(vocab, generator=r.generator, device=device))
            for r in rows
        ]

        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)
        ranked = [j for j, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1]
        if len(ranked) < len(rows):
            full = [j for j, r in enumerate(rows) if not (r.params.top_k > 0 or r.params.top_p < 1)]
            token_ids[full] = self._sample_full(
                logits[full], [rows[j] for j in full], [own_noise[j] for j in full]
            )
        if ranked:
            width = max(
                min(rows[j].params.top_k, vocab) if rows[j].params.top_k > 0 else NUCLEUS_CANDIDATES
                for j in ranked
            )
            chosen, overflow = self._sample_ranked(
                logits[ranked],
                [rows[j] for j in ranked],
                min(width, vocab),
                [own_noise[j] for j in ranked],
            )
            token_ids[ranked] = chosen
            if overflow:
                # Nuclei wider than the candidates: redo those rows over the whole vocabulary.
                redo = [ranked[k] for k in overflow]
                chosen, _ = self._sample_ranked(
                    logits[redo], [rows[j] for j in redo], vocab, [own_noise[j] for j in redo]
                )
                token_ids[redo] = chosen
        return token_ids

    def _noise(
        self,
        own_noise: list[torch.Tensor | None],
        width: int,
        device: torch.device,
        token_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        """Gumbel noise [rows, width]: rows with their own take it, gathered at `token_idx`."""
        noise = torch.empty(len(own_noise), width, device=device)
        shared = [k for k, own in enumerate(own_noise) if own is None]
        if shared:
            uniform = torch.rand(
                len(shared), width, device=device, generator=self.shared_generator(device)
            )
            noise[shared] = _gumbel(uniform)
        for k, own in enumerate(own_noise):
            if own is not None:
                noise[k] = own if token_idx is None else own[token_idx[k]]
        return noise

    def _sample_full(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        own_noise: list[torch.Tensor | None],
    ) -> torch.Tensor:
        """Rows without top-k/top-p: min-p in vocabulary space, then a draw over all tokens."""
        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); log(0) = -inf keeps all.
            log_min_p = torch.tensor(min_p, device=logits.device).log().unsqueeze(1)
            floor = logits.amax(dim=-1, keepdim=True) + log_min_p
            logits = logits.masked_fill(logits < floor, -math.inf)
        noise = self._noise(own_noise, logits.shape[1], logits.device, None)
        return (logits + noise).argmax(dim=-1)

    def _sample_ranked(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        width: int,
        own_noise: list[torch.Tensor | None],
    ) -> tuple[torch.Tensor, list[int]]:
        """Top-k / top-p / min-p over the `width` best candidates of each row.

        Returns the tokens and the positions of rows whose top-p nucleus did not fit in
        `width` candidates (their token is not valid; redo them with width = vocab).
        """
        device, vocab = logits.device, logits.shape[1]
        values, token_idx = logits.topk(width, dim=-1)  # sorted, best first
        top_k = torch.tensor(
            [min(r.params.top_k, width) if r.params.top_k > 0 else width for r in rows],
            device=device,
        )
        keep = torch.arange(width, device=device) < top_k.unsqueeze(1)

        # Top-p needs probabilities renormalized over the top-k set when there is one,
        # over the whole vocabulary otherwise.
        has_top_k = torch.tensor([r.params.top_k > 0 for r in rows], device=device)
        norm = values.masked_fill(~keep, -math.inf).logsumexp(dim=-1)
        best = values[:, :1]
        no_top_k = [k for k, r in enumerate(rows) if r.params.top_k <= 0]
        if no_top_k:
            shifted = logits[no_top_k] - best[no_top_k]
            norm[no_top_k] = best[no_top_k].squeeze(1) + shifted.exp_().sum(dim=-1).log_()
        probs = (values - norm.unsqueeze(1)).exp_().masked_fill_(~keep, 0.0)
        cumulative = probs.cumsum(dim=-1)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device).unsqueeze(1)
        keep &= (cumulative - probs) < top_p  # the best token is always kept

        overflow: list[int] = []
        if width < vocab:
            short = (~has_top_k) & (cumulative[:, -1] < top_p.squeeze(1))
            overflow = short.nonzero().flatten().tolist()

        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            log_min_p = torch.tensor(min_p, device=device).log().unsqueeze(1)
            keep &= values >= best + log_min_p
        noise = self._noise(own_noise, width, device, token_idx)
        choice = (values.masked_fill(~keep, -math.inf) + noise).argmax(dim=-1, keepdim=True)
        return token_idx.gather(1, choice).squeeze(1), overflow

    def _logprobs(
        self, raw: torch.Tensor, rows: list[SamplingRow], token_ids: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        token_list = token_ids.tolist()
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        logprobs = raw[wanted].log_softmax(dim=-1)
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
