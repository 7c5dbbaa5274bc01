"""Text for a request's outputs, made in the serving front: the engine core sends token ids only.

Each sampled sequence has an incremental detokenizer here (stop strings, min_tokens,
include_stop_str_in_output, skip_special_tokens, as the engine's own would). When a stop string
matches, that sequence is finished on the spot: its completion says "stop" with the string, the
tokens and text after it are dropped, and the core is told to finish the sequence (it may have
run one more step meanwhile; what that step made never leaves). Beams are decoded whole at the
end, as the engine decodes them offline.
"""

from __future__ import annotations

from collections.abc import Callable

from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.model.detokenizer import (
    IncrementalDetokenizer,
    TokenDecoder,
    stop_token_text_left_out,
)
from engine_service.model.sampling_params import SamplingParams

# (request_id, sequence index, the stop string): tells the core to finish that sequence.
FinishSequence = Callable[[int, str], None]


class _SequenceText:
    __slots__ = ("cumulative_logprob", "detokenizer", "num_kept", "stop")

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.num_kept = 0  # output tokens passed on (those up to a matched stop string)
        self.stop: str | None = None  # the stop string that finished it here
        # The kept tokens' logprob sum once a stop string finished it here: the core's goes
        # on over the tokens cut (one more step may run before it hears of the stop).
        self.cumulative_logprob: float | None = None


class RequestText:
    """One request's detokenizers; `apply` turns each core output into the client's."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 finish_sequence: FinishSequence, decoder: TokenDecoder | None = None) -> None:
        self._tokenizer = tokenizer
        self._decoder = decoder  # shared by the front's requests (single tokens' texts kept)
        self._prompt_token_ids = prompt_token_ids
        self._params = params
        self._finish_sequence = finish_sequence
        self._sequences: dict[int, _SequenceText] = {}

    def _sequence(self, index: int) -> _SequenceText:
        sequence = self._sequences.get(index)
        if sequence is None:
            params = self._params
            sequence = self._sequences[index] = _SequenceText(IncrementalDetokenizer(
                self._tokenizer, self._prompt_token_ids, params.stop,
                params.include_stop_str_in_output, params.skip_special_tokens,
                min_tokens=params.min_tokens, decoder=self._decoder))
        return sequence

    def apply(self, output: RequestOutput) -> None:
        if self._params.use_beam_search:
            if output.finished:
                for completion in output.outputs:
                    self._decode_beam(completion)
            return
        for completion in output.outputs:
            self._apply(completion, output.finished)

    def _apply(self, completion: CompletionOutput, final: bool) -> None:
        sequence = self._sequence(completion.index)
        detokenizer = sequence.detokenizer
        if sequence.stop is not None:  # finished here already: only its whole fields remain
            completion.token_ids_delta, completion.text_delta = [], ""
            if completion.logprobs_delta is not None:
                completion.logprobs_delta = []
            completion.cumulative_logprob = sequence.cumulative_logprob
        else:
            text: list[str] = []
            kept = 0
            # A stop token that ended the sequence (EOS, stop_token_ids) has no text, as in
            # vLLM (include_stop_str_in_output keeps it); its id stays in token_ids.
            stop_token = stop_token_text_left_out(completion.finish_reason,
                                                  completion.stop_reason,
                                                  self._params.include_stop_str_in_output)
            last = len(completion.token_ids_delta) - 1
            for i, token in enumerate(completion.token_ids_delta):
                kept += 1
                if stop_token and i == last:
                    break
                text.append(detokenizer.add_token(token))
                if detokenizer.matched_stop is not None:
                    sequence.stop = detokenizer.matched_stop
                    self._finish_sequence(completion.index, sequence.stop)
                    break
            if kept < len(completion.token_ids_delta):
                completion.token_ids_delta = completion.token_ids_delta[:kept]
                if completion.logprobs_delta is not None:
                    cut = completion.logprobs_delta[kept:]
                    completion.logprobs_delta = completion.logprobs_delta[:kept]
                    if completion.cumulative_logprob is not None:
                        completion.cumulative_logprob -= sum(lp.logprob for lp in cut)
            if sequence.stop is not None:
                sequence.cumulative_logprob = completion.cumulative_logprob
            sequence.num_kept += kept
            if sequence.stop is None and completion.finish_reason is not None:
                text.append(detokenizer.finish())  # EOS, length or abort: release the tail
            completion.text_delta = "".join(text)
        if sequence.stop is not None:
            completion.finish_reason, completion.stop_reason = "stop", sequence.stop
        completion.num_tokens = min(completion.num_tokens, sequence.num_kept)
        if final:
            completion.text = detokenizer.text
            completion.token_ids = completion.token_ids[:sequence.num_kept]
            if completion.logprobs is not None:
                completion.logprobs = completion.logprobs[:sequence.num_kept]

    def _decode_beam(self, completion: CompletionOutput) -> None:
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, self._prompt_token_ids, [],
            skip_special_tokens=self._params.skip_special_tokens, decoder=self._decoder)
        tokens = completion.token_ids
        if tokens and stop_token_text_left_out(completion.finish_reason, completion.stop_reason,
                                               self._params.include_stop_str_in_output):
            tokens = tokens[:-1]  # (ended by a stop token: its text left out, as _apply's)
        for token in tokens:
            detokenizer.add_token(token)
        detokenizer.finish()
        completion.text = completion.text_delta = detokenizer.text
