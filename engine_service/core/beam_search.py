"""Beam search over the paged KV cache, scored exactly as HF transformers' `_beam_search`.

One BeamSearch per request. Each step, every live beam has the logits of its next token; the
candidates are the best `max(2, 1 + #stop tokens) * beam_width` of (beam score + token
logprob) over all beams, taken by one `topk` over the flattened (beam, vocab) scores in the
beams' order, so ties break as they do in HF. Of those:
  - the best beam_width that do not end (stop token, or the length limit) become the next
    step's beams;
  - the ones among the first beam_width that end are finished hypotheses, scored
    cum_logprob / generated_len ** length_penalty (the stop token counted), and kept if they
    are among the beam_width best so far;
  - the search ends when every candidate ends (max_tokens), when early_stopping is True and
    beam_width hypotheses are finished, or when HF's heuristic says no running beam can still
    beat the worst kept hypothesis (early_stopping False / "never").
Every score is a float32 tensor op in HF's order, so equal logits give equal beams. One
departure: HF marks empty finished slots (and candidates that did not finish) with the score
-1e9, so a finished beam whose length-penalized score is below -1e9 (a negative length_penalty
on a long beam: -20 / 12 ** -8 is -8.6e9) can never be kept, and the search returns nothing.
Here those slots score -inf: a finished beam always beats an empty slot.

On the KV side (`advance`) a beam chosen k times continues as itself and k - 1 forks that share
all its blocks (the partial last block is copied on write when each one writes it); a beam
chosen 0 times releases its blocks at once. Finished hypotheses hold no KV, only token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_service.core.kv_cache_manager import KVCacheManager
from engine_service.core.sequence import Sequence, SequenceGroup, SequenceStatus

# HF's "never pick this" score: added to a candidate that must not be chosen.
NEVER = -1.0e9
# The score of an empty finished slot (and of a candidate that did not finish): below every
# finished beam's, however strongly length-penalized (HF uses NEVER here; see the module doc).
EMPTY = -float("inf")
# length_penalty is bounded where requests are checked (core/request_limits.py,
# max_abs_length_penalty), so a finished beam's score stays finite in float32.


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # generated tokens, the stop token included
    cum_logprob: float  # sum of the tokens' logprobs
    score: float  # cum_logprob / len(token_ids) ** length_penalty: what beams are ranked by
    finish_reason: str  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id, when one of stop_token_ids ended it


@dataclass(slots=True)
class BeamChoice:
    """A beam of the next step: beam `parent` of this step extended by `token_id`."""

    parent: int
    token_id: int
    cum_logprob: float


class BeamSearch:
    def __init__(
        self,
        beam_width: int,
        length_penalty: float,
        early_stopping: bool | str,
        eos_token_ids: set[int],
        stop_token_ids: list[int],
        min_tokens: int,
        num_prompt_tokens: int,
        max_total_tokens: int,
    ) -> None:
        self.beam_width = beam_width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self._stop_token_ids = frozenset(stop_token_ids)
        self._ending = frozenset(eos_token_ids) | self._stop_token_ids  # tokens that end a beam
        self._ending_tokens = sorted(self._ending)
        self.min_tokens = min_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.max_total_tokens = max_total_tokens  # prompt + max_tokens, within the context
        # HF keeps this many candidates so that beam_width of them survive even when every
        # beam's best tokens are stop tokens.
        self.num_candidates = max(2, 1 + len(self._ending_tokens)) * beam_width
        # Cumulative logprobs of the live beams, in the order of the group's sequences. The
        # prompt is the one beam of the first step.
        self.scores: list[float] = [0.0]
        # beam_width slots of finished hypotheses, best first, as HF keeps them (unfilled
        # slots score EMPTY and are not `filled`).
        self._finished_scores = torch.full((1, beam_width), EMPTY, dtype=torch.float32)
        self._finished: list[Hypothesis | None] = [None] * beam_width
        self._filled = torch.zeros((1, beam_width), dtype=torch.bool)
        self._can_improve = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False
        self.num_steps = 0

    # ---- scoring ------------------------------------------------------------------------
    def step(self, logits: torch.Tensor, beams: list[Sequence]) -> list[BeamChoice]:
        """One search step from the live beams' next-token logits [len(beams), vocab] (rows
        in the order of `beams`). Records finished hypotheses; returns the next step's beams,
        best first ([] when the search is over)."""
        if self.done:
            raise RuntimeError("beam search step after the search ended")
        if logits.shape[0] != len(beams) or len(beams) != len(self.scores):
            raise ValueError(
                f"logits must have one row per live beam ({len(self.scores)}), got "
                f"{logits.shape[0]} rows for {len(beams)} beams"
            )
        width = self.beam_width
        num_generated = beams[0].num_output_tokens
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if num_generated < self.min_tokens and self._ending_tokens:
            logprobs[:, self._ending_tokens] = -float("inf")
        scores = self.scores
        if self.num_steps == 0:
            # The first step: HF runs beam_width copies of the prompt, all but the first
            # scored NEVER, so that only the first one's tokens are picked.
            logprobs = logprobs[:1].expand(width, -1)
            scores = scores[:1] + [NEVER] * (width - 1)
        vocab = logprobs.shape[1]
        totals = logprobs + torch.tensor(scores, dtype=torch.float32)[:, None]
        num_candidates = min(self.num_candidates, totals.numel())
        values, flat = totals.reshape(1, -1).topk(num_candidates)
        parents = (flat[0] // vocab).tolist()
        tokens = (flat[0] % vocab).tolist()

        generated_len = num_generated + 1
        at_limit = self.num_prompt_tokens + generated_len >= self.max_total_tokens
        ends = torch.tensor(
            [[at_limit or t in self._ending for t in tokens]], dtype=torch.bool
        )
        running_values = values + ends.to(torch.float32) * NEVER
        keep = running_values.topk(min(width, num_candidates)).indices[0].tolist()
        self._record_finished(values, ends, parents, tokens, beams, generated_len)
        self.num_steps += 1

        best_running = running_values[:, keep[0] : keep[0] + 1]
        self._update_can_improve(best_running, generated_len)
        all_filled = bool(self._filled.all())
        if not self._can_improve or (all_filled and self.early_stopping is True) or bool(
            ends.all()
        ):
            self.done = True
            self.scores = []
            return []
        running = [
            BeamChoice(parents[i], tokens[i], float(running_values[0, i])) for i in keep
        ]
        self.scores = [c.cum_logprob for c in running]
        return running

    def _record_finished(
        self,
        values: torch.Tensor,
        ends: torch.Tensor,
        parents: list[int],
        tokens: list[int],
        beams: list[Sequence],
        generated_len: int,
    ) -> None:
        """HF's _update_finished_beams: only the first beam_width candidates may finish; the
        finished set keeps the beam_width best length-penalized scores."""
        width = self.beam_width
        top = torch.arange(values.shape[1]) < width
        just_finished = ends & top
        penalized = values / (generated_len**self.length_penalty)
        full = bool(self._filled.all()) and self.early_stopping is True
        penalized = penalized + float(full) * NEVER
        penalized = penalized + float(not self._can_improve) * NEVER
        penalized = torch.where(just_finished, penalized, EMPTY)
        merged = torch.cat((self._finished_scores, penalized), dim=1)
        order = merged.topk(width).indices[0].tolist()
        merged_filled = torch.cat((self._filled, just_finished), dim=1)
        finished: list[Hypothesis | None] = []
        for i in order:
            if i < width:
                finished.append(self._finished[i])
                continue
            c = i - width
            if not just_finished[0, c]:
                finished.append(None)  # an unfilled slot, as in HF
                continue
            token = tokens[c]
            is_stop = token in self._ending
            finished.append(
                Hypothesis(
                    token_ids=beams[parents[c]].output_token_ids + [token],
                    cum_logprob=float(values[0, c]),
                    score=float(merged[0, i]),
                    finish_reason="stop" if is_stop else "length",
                    stop_reason=token if token in self._stop_token_ids else None,
                )
            )
        index = torch.tensor([order])
        self._finished_scores = merged.gather(1, index)
        self._filled = merged_filled.gather(1, index)
        self._finished = finished

    def _update_can_improve(self, best_running: torch.Tensor, generated_len: int) -> None:
        """HF's _check_early_stop_heuristic: can the best running beam still beat the worst
        finished hypothesis? Unfilled slots always can be beaten."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_total_tokens - self.num_prompt_tokens
        else:
            best_len = generated_len
        best_possible = best_running / (best_len**self.length_penalty)
        worst = torch.where(
            self._filled, self._finished_scores.min(dim=1, keepdim=True).values, EMPTY
        )
        self._can_improve = self._can_improve and bool((best_possible > worst).any())

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (the search must be over)."""
        return [h for h in self._finished[:n] if h is not None]

    # ---- the KV side --------------------------------------------------------------------
    def advance(
        self,
        group: SequenceGroup,
        logits: torch.Tensor,
        kv: KVCacheManager,
        next_seq_id: Callable[[], int],
    ) -> None:
        """Run one step on the group's live beams (logits in their order) and reshape the
        group: forks for beams chosen more than once, freed blocks for beams not chosen, all
        beams freed when the search ends."""
        beams = group.live_seqs()
        choices = self.step(logits, beams)
        group.has_forked = True  # re-admission after recompute shares the prompt
        chosen = {c.parent for c in choices}
        for index, beam in enumerate(beams):
            if index not in chosen:
                # A dead beam: its blocks go back now (shared ones lose one reference).
                kv.forget(beam)
                beam.status = SequenceStatus.FINISHED
        if self.done:
            group.seqs = beams  # all finished: the group is over
            return
        continued: set[int] = set()
        next_beams: list[tuple[Sequence, int]] = []
        for choice in choices:
            parent = beams[choice.parent]
            if choice.parent in continued:
                beam = Sequence(
                    seq_id=next_seq_id(),
                    index=0,
                    token_ids=list(parent.token_ids),
                    num_prompt_tokens=parent.num_prompt_tokens,
                    status=SequenceStatus.RUNNING,
                    num_computed_tokens=parent.num_computed_tokens,
                )
                kv.fork(parent, beam)  # shares every block, the partial last one included
            else:
                continued.add(choice.parent)
                beam = parent
            next_beams.append((beam, choice.token_id))
        # Tokens are appended only after every fork: a fork copies its parent's tokens.
        for index, (beam, token) in enumerate(next_beams):
            beam.token_ids.append(token)
            beam.index = index
        group.seqs = [beam for beam, _ in next_beams]
