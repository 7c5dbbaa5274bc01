"""The engine: requests in, one scheduled forward + sampling per step, outputs out.

One thread owns an LLMEngine and is the only writer of its state (scheduler queues, KV cache
manager, block pool, the prefix policy's mirror). Other threads send commands with `post`;
they run between two steps. Readers use `snapshot`, the stats the engine publishes each step.
"""

import functools
import itertools
import logging
import queue
import time
from collections.abc import Callable, Iterator

import torch

from engine_service.core.beam_search import BeamSearch
from engine_service.core.block_hash import BlockHasher
from engine_service.core.block_pool import BlockPool
from engine_service.core.config import EngineConfig
from engine_service.core.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    RequestTooLargeError,
)
from engine_service.core.kv_cache_manager import KVCacheManager
from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.core.pin_budget import PinBudget, PinBudgetConfig, request_demand
from engine_service.core.prefix_policy import PrefixPolicy
from engine_service.core.request_limits import RequestLimits, truncated_prompt
from engine_service.core.scheduler import Scheduler, SchedulerConfig
from engine_service.core.scheduler_output import ScheduledSeq
from engine_service.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine_service.core.stats import EngineStats
from engine_service.model.config import ModelConfig, load_model_config
from engine_service.model.detokenizer import (
    IncrementalDetokenizer,
    TokenDecoder,
    stop_token_text_left_out,
)
from engine_service.model.dtype import DTYPES
from engine_service.model.fingerprint import model_identity, weights_fingerprint
from engine_service.model.grammar import GrammarCompiler, follow_resumed_tokens, new_matcher
from engine_service.model.kv_cache_setup import graph_rows, setup_kv_cache, uses_cuda_graphs
from engine_service.model.prompt_logprobs import score_tokens
from engine_service.model.runner import ModelRunner, kv_bytes_per_block
from engine_service.model.sampler import Sampler, SamplingRow, make_generator
from engine_service.model.sampling_params import SamplingParams
from engine_service.model.tokenizer import load_tokenizer
from engine_service.model.tokenizer_eos import read_eos_token_id

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "LLMEngine", "RequestTooLargeError"]


Command = Callable[["LLMEngine"], None]
# The pin budget is recomputed when requests start or stop holding blocks, and at least this
# often while the engine steps (a peak of demand ages out with time alone).
PIN_BUDGET_REFRESH_S = 1.0


class LLMEngine:
    def __init__(self, config: EngineConfig, policy: PrefixPolicy | None = None) -> None:
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device must be 'cpu' on this machine: CUDA is not available")
        self.config = config
        self.model_config: ModelConfig = load_model_config(config.model)
        mc = self.model_config
        # Loaded now when this engine makes text; otherwise (a serving core: the front makes
        # it) on first use, which a core never makes: its EOS id is read from the files.
        self._tokenizer = None
        self._token_decoder: TokenDecoder | None = None
        if config.detokenize:
            self._load_tokenizer()
        longest = mc.longest_context()
        self.max_model_len = min(config.max_model_len or longest, longest)
        if longest < mc.max_position_embeddings:
            log.warning("the model attends within a sliding window of %d tokens, this engine "
                        "to the whole context: it serves at most %d tokens a sequence (of the "
                        "model's %d positions)", mc.sliding_window, self.max_model_len,
                        mc.max_position_embeddings)
        if config.tensor_parallel_size > 1:
            from engine_service.model.parallel.launch import start_tensor_parallel

            self.runner = start_tensor_parallel(config, mc, self.max_model_len)
        else:
            self.runner = ModelRunner(
                mc,
                dtype=config.dtype,
                device=config.device,
                kernel_backend=config.kernel_backend,
                block_size=config.block_size,
                max_model_len=self.max_model_len,
            )
        # Per rank under tensor parallelism (the runner's model is the rank's heads).
        block_bytes = kv_bytes_per_block(self.runner.config, config.block_size,
                                         DTYPES[config.dtype])
        self.kv_bytes_per_block = block_bytes
        num_cpu_blocks = config.swap_space // block_bytes if config.preemption_mode == "swap" else 0
        # After the weights: the pool gets what they and a profiled forward leave; then every
        # kernel variant is warmed up, so the server goes SERVING only once nothing compiles.
        try:
            self.kv_setup = setup_kv_cache(self.runner, config, num_cpu_blocks,
                                           self.max_model_len)
        except BaseException:
            self.close()
            raise
        if uses_cuda_graphs(config, self.runner):
            added = self.runner.capture_decode_graphs(graph_rows(config), self.max_model_len)
            added += self.runner.capture_mixed_graphs(config.max_num_batched_tokens)
            plan = self.kv_setup.plan
            if plan is not None and added > plan.cuda_graph_bytes:
                log.warning("the CUDA graphs took %.1f MiB, more than the %.1f MiB the "
                            "KV plan kept for them (the margin covers the rest; "
                            "--enforce-eager runs without them)", added / 2**20,
                            plan.cuda_graph_bytes / 2**20)
        elif config.device == "cuda":
            log.info("steps run eagerly: %s", "enforce_eager" if config.enforce_eager
                     else f"the {self.runner.kernels.name} kernels have no CUDA graphs")
        num_blocks = self.kv_setup.num_blocks
        # The one block-hash chain of this engine: the cache, PinPrefix and the index link.
        fingerprint = weights_fingerprint(mc.path, mc.gguf_file)
        identity = model_identity(config.served_model_name, fingerprint, mc.architecture)
        self.hasher = BlockHasher(identity, config.dtype, config.block_size)
        self.pool = BlockPool(num_blocks, policy)
        self.kv = KVCacheManager(
            self.pool, self.hasher, config.enable_prefix_caching, num_cpu_blocks
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens, config.max_num_seqs, config.preemption_mode,
                defer_shared_prefill=config.defer_shared_prefill,
            ),
            self.kv,
        )
        eos = set(mc.eos_token_ids)
        tokenizer_eos = self._tokenizer_eos_token_id()
        if tokenizer_eos is not None:
            eos.add(tokenizer_eos)
        self.eos_token_ids = eos
        self.pin_budget = PinBudget(num_blocks, PinBudgetConfig(
            config.pin_budget_floor, config.pin_budget_ceiling, config.pin_budget_window_s))
        # (scheduler.num_running_changes, the policy told) at the last update, and when.
        self._pin_budget_seen: tuple[int, PrefixPolicy | None] = (-1, None)
        self._pin_budget_at = 0.0
        # What a request must fit (the serving front checks the same, from EngineInfo).
        self.limits = RequestLimits(
            vocab_size=mc.vocab_size, max_model_len=self.max_model_len,
            num_blocks=self.pool.num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            has_tokenizer=not config.skip_tokenizer_init)
        self.sampler = Sampler(mc.vocab_size, eos, seed=config.seed, device=self.runner.device)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._groups: dict[str, SequenceGroup] = {}
        # Requests whose prompt logprobs are not all scored yet (most steps skip the check).
        self._scoring: set[str] = set()
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefill + decode)
        # Commands from other threads, run by the engine thread between steps; `wake` tells
        # whoever drives the engine that one is waiting (the async front sets it).
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.wake: Callable[[], None] = lambda: None
        self._update_pin_budget()  # the policy's budget from the start, not from the first step
        self.snapshot: EngineStats = self.stats()
        log.info(
            "engine ready: %s, %d KV blocks of %d tokens (%.1f MiB), device %s",
            mc.path,
            num_blocks,
            config.block_size,
            num_blocks * block_bytes / 2**20,
            config.device,
        )

    # ---- requests -----------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (RequestTooLargeError when it can never fit) naming the
        field. Reads only this engine's fixed limits (RequestLimits, which the serving front
        holds too): safe from any thread."""
        self.limits.validate(prompt_token_ids, params)

    @property
    def max_beam_width(self) -> int:
        """The widest beam search this engine runs: all beams step in one forward."""
        return self.limits.max_beam_width

    def blocks_for_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.limits.blocks_for_request(num_prompt_tokens, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        final_output_only: bool = False,
        pin_prefill: bool = False,
        grammar: object | None = None,
    ) -> None:
        """Queue a request. Each step that runs it reports what is new (deltas), its last
        output the whole completions; with final_output_only (the offline API), only that
        last output is made. pin_prefill: PinPrefix computing the prefix it pins next (not
        counted in the pin budget's demand). grammar: params.structured_outputs compiled
        by self.grammars (compiled here when not given)."""
        if request_id in self._groups:
            raise DuplicateRequestError(
                "request_id", f"request_id must be unique among live requests, got {request_id!r}"
            )
        prompt_token_ids = truncated_prompt(prompt_token_ids, params, self.limits)
        if params.bad_words and self.tokenizer is not None:  # (the tokenizer loads lazily)
            try:
                params.tokenize_bad_words(self.tokenizer)
            except ValueError as error:
                raise InvalidRequestError("bad_words", str(error)) from None
        self.validate_request(prompt_token_ids, params)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.grammars.compile(params.structured_outputs)
        group = SequenceGroup(
            request_id=request_id,
            seqs=[],
            params=params,
            prompt=prompt,
            cache_salt=cache_salt,
            priority=priority,
            arrival_order=next(self._arrivals),
            final_output_only=final_output_only,
            pin_prefill=pin_prefill,
            plain_greedy=(params.is_greedy and not params.has_penalties
                          and params.logprobs is None and not params.min_tokens
                          and not params.logit_bias and grammar is None
                          and params.allowed_token_ids is None
                          and not params.bad_words_token_ids),
            grammar=grammar,
            only_stops_allowed=params.only_stops_allowed(self.eos_token_ids),
        )
        if params.use_beam_search:
            # Beams stream nothing (the best ones are known only at the end): no detokenizer.
            group.beam = self._new_beam_search(len(prompt_token_ids), params)
            group.seqs.append(Sequence(next(self._seq_ids), 0, list(prompt_token_ids),
                                       len(prompt_token_ids)))
        else:
            group.seqs.append(self._new_sequence(list(prompt_token_ids), 0, group))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first token: nothing before it scores it
            if group.scores_prompt:
                self._scoring.add(request_id)
        self._groups[request_id] = group
        self.scheduler.add(group)

    def _new_beam_search(self, num_prompt_tokens: int, params: SamplingParams) -> BeamSearch:
        max_len = self.max_model_len
        if params.max_tokens is not None:
            max_len = min(max_len, num_prompt_tokens + params.max_tokens)
        return BeamSearch(
            beam_width=params.beam_width,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_ids=set() if params.ignore_eos else self.eos_token_ids,
            stop_token_ids=params.stop_token_ids,
            min_tokens=params.min_tokens,
            num_prompt_tokens=num_prompt_tokens,
            max_total_tokens=max_len,
        )

    def _new_sequence(self, token_ids: list[int], index: int, group: SequenceGroup) -> Sequence:
        params = group.params
        seq = Sequence(
            seq_id=next(self._seq_ids),
            index=index,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
        )
        seq.ending_token_ids = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else self.eos_token_ids)
        self._set_max_num_tokens(seq, params)
        if params.seed is not None:
            seq.generator = make_generator(params.seed, index, self.runner.device)
        if self.config.detokenize and self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                min_tokens=params.min_tokens,
                decoder=self._token_decoder,
            )
            # Only a stop string or a streamed output reads the text before the end.
            seq.text_deferred = group.final_output_only and not params.stop
        seq.logprobs = [] if params.logprobs is not None else None
        if group.grammar is not None:
            seq.matcher = new_matcher(group.grammar)
            resumed = params.structured_outputs.resumed_tokens
            if resumed:  # refused at add_request (index 0) if at all: never in a fork
                follow_resumed_tokens(seq.matcher, token_ids[-resumed:])
        return seq

    def _set_max_num_tokens(self, seq: Sequence, params: SamplingParams) -> None:
        seq.max_num_tokens = self.max_model_len
        if params.max_tokens is not None:
            seq.max_num_tokens = min(seq.max_num_tokens, seq.num_prompt_tokens + params.max_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; its final output, or None if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        self._scoring.discard(request_id)
        self.scheduler.abort(request_id)
        for seq in group.seqs:
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                self._release_penalty_slot(seq)
        return self._make_output(group)

    def finish_sequence(self, request_id: str, index: int, stop: str) -> RequestOutput | None:
        """A stop string matched outside the engine (the serving front detokenizes when the
        config says detokenize=False): sequence `index` of the request ends now, its blocks
        freed. The request's final output when that was its last live sequence, else None."""
        group = self._groups.get(request_id)
        seq = None if group is None else next((s for s in group.seqs if s.index == index), None)
        if seq is None or seq.is_finished:
            return None
        if all(s is seq or s.is_finished for s in group.seqs):
            seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, "stop", stop
            self._release_penalty_slot(seq)
            return self.abort_request(request_id)  # frees the group wherever it waits
        if seq.status == SequenceStatus.SWAPPED:
            self.kv.free_cpu([seq])
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, "stop", stop
        self.kv.forget(seq)
        self._release_penalty_slot(seq)
        return None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- commands from other threads ---------------------------------------------------
    def post(self, command: Command) -> None:
        """Run command(engine) on the engine thread between two steps (any thread may call)."""
        self._commands.put(command)
        self.wake()

    def run_commands(self) -> None:
        """Run the commands posted so far (the engine thread calls this between steps)."""
        # Idle, no step lapses the pins whose TTL ran out: here, before the commands (a pin
        # must not be refused for the room of one that lapsed) and after them, so that the
        # stats (and the index, which lapses them on its own) do not count them until the
        # next request.
        lapsed = self.pool.policy.lapse_pins()
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command(self)
            ran = True
        if self.pool.policy.lapse_pins() or lapsed or ran:
            self.snapshot = self.stats()

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.run_commands()
        # The policy hooks bracket every step: a prefix-index policy applies what the index
        # decided before scheduling and records the step's ops after it.
        policy = self.pool.policy
        policy.begin_step()
        try:
            return self._step()
        finally:
            self._update_pin_budget()
            policy.end_step()
            self.snapshot = self.stats()

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        # Moves first, even in a step that runs no forward: a swap-out recorded by a
        # preemption must reach the CPU pool before those device blocks are reused.
        self.runner.apply_moves(sched.moves)
        if not sched.scheduled:
            return []
        self.num_steps += 1
        self.num_computed_tokens += sched.num_batched_tokens
        sampling = [s for s in sched.scheduled if s.samples]
        scored = self._prompt_positions(sched.scheduled) if self._scoring else []
        if scored:
            logits = self.runner.execute(sched.scheduled, scores_prompts=True)
            self._score_prompts(logits[len(sampling):], scored)
            logits = logits[:len(sampling)]
        else:
            logits = self.runner.execute(sched.scheduled)
        self.scheduler.after_forward(sched)
        self._sample(logits, sampling)
        touched = {id(s.group): s.group for s in sched.scheduled}
        # A beam search request has no output before its end: which beams win is not known.
        outputs = [
            self._make_output(g) for g in touched.values()
            if (g.beam is None and not g.final_output_only) or g.is_finished
        ]
        for group in self.scheduler.remove_finished():
            self._groups.pop(group.request_id, None)
            self._scoring.discard(group.request_id)
        return outputs

    def _prompt_positions(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Sets prompt_positions on the items whose chunk computes positions that score prompt
        tokens not scored yet (a recomputed prompt is not scored twice); those items."""
        scored = []
        for item in scheduled:
            done = item.group.prompt_logprobs
            if done is None or item.group.request_id not in self._scoring:
                continue
            seq = item.seq
            start = max(seq.num_computed_tokens, len(done) - 1)
            end = min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if start < end:
                item.prompt_positions = range(start, end)
                scored.append(item)
        return scored

    def _score_prompts(self, logits: torch.Tensor, scored: list[ScheduledSeq]) -> None:
        """logits: the rows of each item's prompt_positions, in order."""
        token_ids: list[int] = []
        num_tops: list[int] = []
        for item in scored:
            prompt = item.seq.token_ids
            token_ids.extend(prompt[p + 1] for p in item.prompt_positions)
            num_tops.extend([item.group.params.prompt_logprobs] * len(item.prompt_positions))
        results = score_tokens(logits[:, : self.model_config.vocab_size], token_ids, num_tops)
        at = 0
        for item in scored:
            group, count = item.group, len(item.prompt_positions)
            group.prompt_logprobs.extend(results[at : at + count])
            at += count
            if not group.scores_prompt:
                self._scoring.discard(group.request_id)

    def _update_pin_budget(self) -> None:
        """Recomputes the pin budget when requests started or stopped holding blocks, or
        PIN_BUDGET_REFRESH_S passed, and tells the policy of a move worth telling (a policy it
        has not told yet, the index's after connect_prefix_index, hears it whatever it is)."""
        sched, policy = self.scheduler, self.pool.policy
        now = time.monotonic()
        changes, told = self._pin_budget_seen
        if (changes, told) == (sched.num_running_changes, policy) \
                and now - self._pin_budget_at < PIN_BUDGET_REFRESH_S:
            return
        if changes != sched.num_running_changes:
            # Each request at its peak: what it holds plus what it needs to finish, less the
            # pinned blocks it reads (pins already). A pin's prefill is not: its blocks are
            # the pin's, which the budget was checked for before it ran (counted, it would
            # shrink the budget below the pin it computes, and hold it there for the window).
            demand = sum(
                request_demand(self.limits.blocks_for_request(g.num_prompt_tokens, g.params),
                               self._table_hashes(g), policy.is_pinned)
                for queue_ in (sched.running, sched.swapped) for g in queue_
                if not g.pin_prefill)
            self.pin_budget.observe(demand)
        else:
            self.pin_budget.refresh()
        if told is not policy:
            self.pin_budget.forget_report()
        self._pin_budget_seen, self._pin_budget_at = (sched.num_running_changes, policy), now
        blocks = self.pin_budget.report()
        if blocks is not None:
            policy.set_pin_budget(blocks)

    def _table_hashes(self, group: SequenceGroup) -> Iterator[bytes | None]:
        """The block hashes of a live sequence's device table, in order (the group's samples
        or beams share its prompt blocks); none for a group swapped out."""
        blocks = self.pool.blocks
        for seq in group.seqs:
            table = self.kv.block_table(seq)
            if table:
                return (blocks[block_id].block_hash for block_id in table)
        return iter(())

    def _sample(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> None:
        """Next tokens for the sampling rows: beam search requests take their beam step, the
        others go through the sampler (logits rows follow `items`)."""
        beam_rows: dict[int, tuple[SequenceGroup, dict[int, int]]] = {}
        sampled: list[int] = []
        for i, item in enumerate(items):
            if item.group.beam is None:
                sampled.append(i)
            else:
                beam_rows.setdefault(id(item.group), (item.group, {}))[1][item.seq.seq_id] = i
        for group, rows in beam_rows.values():
            self._beam_step(group, logits, rows)
        if len(sampled) != len(items):
            logits = logits[torch.tensor(sampled, device=logits.device, dtype=torch.long)]
        self._sample_rows(logits, [items[i] for i in sampled])

    def _beam_step(
        self, group: SequenceGroup, logits: torch.Tensor, rows: dict[int, int]
    ) -> None:
        beams = group.live_seqs()
        if set(rows) != {b.seq_id for b in beams}:
            raise RuntimeError(
                f"request {group.request_id}: a beam step needs every live beam's logits, got "
                f"{len(rows)} of {len(beams)} beams (the scheduler must run them together)"
            )
        group.first_token_time = group.first_token_time or time.monotonic()
        order = torch.tensor([rows[b.seq_id] for b in beams], device=logits.device)
        # The search's own math is a few small ops per request: on the CPU, next to its state.
        beam_logits = logits[order, : self.model_config.vocab_size].cpu()
        group.beam.advance(group, beam_logits, self.kv, lambda: next(self._seq_ids))

    def _sample_rows(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> None:
        row_seqs: list[tuple[Sequence, SequenceGroup]] = []
        logit_rows: list[int] = []
        plain_greedy = True  # every row is an argmax alone (no SamplingRow needed)
        for i, item in enumerate(items):
            group = item.group
            plain_greedy = plain_greedy and group.plain_greedy
            row_seqs.append((item.seq, group))
            logit_rows.append(i)
            if group.params.n > 1 and not group.has_forked:
                for child in self._fork(group, item.seq):
                    row_seqs.append((child, group))
                    logit_rows.append(i)
        if not row_seqs:
            return
        if len(logit_rows) != len(items):
            logits = logits[torch.tensor(logit_rows, device=logits.device)]
        if plain_greedy:
            token_ids = self.sampler.greedy(logits)
            logprobs: list = [None] * len(token_ids)
        else:
            result = self.sampler(logits, self._sampling_rows(row_seqs))
            token_ids, logprobs = result.token_ids, result.logprobs
        now = time.monotonic()
        for (seq, group), token, logprob in zip(row_seqs, token_ids, logprobs, strict=True):
            if group.first_token_time is None:
                group.first_token_time = now
            seq.token_ids.append(token)
            if seq.logprobs is not None:
                seq.logprobs.append(logprob)
                seq.cumulative_logprob += logprob.logprob
            detokenizer = seq.detokenizer
            matched_stop = False
            if (detokenizer is not None and not seq.text_deferred
                    and not (token in seq.ending_token_ids
                             and _ends_without_text(seq, group.params))):
                # Kept until the next output; usually this token's text alone (or nothing).
                delta = detokenizer.add_token(token)
                if delta:
                    seq.unstreamed_text.append(delta)
                matched_stop = detokenizer.matched_stop is not None
            if seq.matcher is not None and not self._follow_grammar(seq, group, token):
                continue
            # Most tokens end nothing: the full check only where one of its reasons may hold.
            if (token in seq.ending_token_ids or len(seq.token_ids) >= seq.max_num_tokens
                    or matched_stop):
                self._check_stop(seq, group, token)
                if seq.is_finished:
                    self.kv.forget(seq)
                    self._release_penalty_slot(seq)

    def _sampling_rows(self, row_seqs: list[tuple[Sequence, SequenceGroup]]) -> list[SamplingRow]:
        """What the sampler reads of each row; penalty counts are built from the tokens once
        per sequence (all of a step's new ones in one upload) and kept up to date after."""
        new = [seq for seq, group in row_seqs
               if group.params.has_penalties and seq.penalty_slot is None]
        if new:
            slots = self.sampler.token_counts.add([(s.prompt_view, s.output_view) for s in new])
            for seq, slot in zip(new, slots, strict=True):
                seq.penalty_slot = slot
        rows = []
        for seq, group in row_seqs:
            row = seq.sampling_row
            if row is None:
                # Views, not copies: a step's work must not grow with the tokens so far.
                row = seq.sampling_row = SamplingRow(group.params, seq.prompt_view,
                                                     seq.output_view, seq.generator,
                                                     matcher=seq.matcher)
            row.penalty_slot = seq.penalty_slot
            rows.append(row)
        return rows

    def _release_penalty_slot(self, seq: Sequence) -> None:
        if seq.penalty_slot is not None:
            self.sampler.token_counts.release(seq.penalty_slot)
            seq.penalty_slot = None

    def _fork(self, group: SequenceGroup, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: n-1 children share every block of the computed prompt."""
        group.has_forked = True
        children = []
        for index in range(1, group.params.n):
            child = self._new_sequence(list(parent.token_ids), index, group)
            child.num_prompt_tokens = parent.num_prompt_tokens
            self._set_max_num_tokens(child, group.params)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.kv.fork(parent, child)
            children.append(child)
        group.seqs.extend(children)
        return children

    def _follow_grammar(self, seq: Sequence, group: SequenceGroup, token: int) -> bool:
        """Advances seq's matcher by `token`; False when that ended seq (the grammar is
        complete, or refused the token, which its mask should have made impossible)."""
        if seq.matcher.accept_token(token):
            if not seq.matcher.is_terminated():
                return True
            # The grammar ended on a stop token: so does the output, even below min_tokens
            # (the sampler let it through only where the grammar allowed nothing else).
            reason = "stop"
        else:
            log.error("request %s: its grammar refused token %d, sampled from its mask; the "
                      "sequence ends (finish reason abort)", group.request_id, token)
            reason = "abort"
        if seq.detokenizer is not None:
            self._catch_up_text(seq, reason == "stop" and token in seq.ending_token_ids
                                and _ends_without_text(seq, group.params))
            seq.unstreamed_text.append(seq.detokenizer.finish())
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.kv.forget(seq)
        self._release_penalty_slot(seq)
        return False

    def _check_stop(self, seq: Sequence, group: SequenceGroup, token: int) -> None:
        """Whether `token`, just appended (and given to the detokenizer unless its text is
        deferred), ends seq, and why."""
        params = group.params
        detokenizer = seq.detokenizer
        reason = None
        stop_reason = None
        num_out = seq.num_output_tokens
        if num_out >= params.min_tokens or group.only_stops_allowed:
            if not params.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop_reason = "stop", token
            elif detokenizer is not None and detokenizer.matched_stop is not None:
                reason, stop_reason = "stop", detokenizer.matched_stop
        if reason is None and params.max_tokens is not None and num_out >= params.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if detokenizer is not None:
                self._catch_up_text(seq, stop_token_text_left_out(
                    reason, stop_reason, params.include_stop_str_in_output))
                seq.unstreamed_text.append(detokenizer.finish())
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = reason
            seq.stop_reason = stop_reason

    @staticmethod
    def _catch_up_text(seq: Sequence, stop_token_last: bool = False) -> None:
        """Detokenize, in one go, the output of a sequence whose text was deferred (read only
        at its end): the same text as token by token (`stop_token_last`: its last token ended
        it, and has no text)."""
        if seq.text_deferred:
            seq.text_deferred = False
            tokens = seq.output_token_ids
            delta = seq.detokenizer.add_tokens(tokens[:-1] if stop_token_last else tokens)
            if delta:
                seq.unstreamed_text.append(delta)

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        finished = group.is_finished
        completions = (
            self._sampled_completions(group, finished) if group.beam is None
            else self._beam_completions(group)
        )
        prompt_logprobs = None
        # With the first token (a chunk can end where the prompt is all scored and the last
        # position, which samples, is not computed yet): a stream resumed after its first
        # token never asks for them again (router/proxy.py).
        if (group.prompt_logprobs is not None and not group.prompt_logprobs_sent
                and not group.scores_prompt
                and (group.first_token_time is not None or finished)):
            prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,  # one list for every output
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens or 0,
            arrival_time=group.arrival_time,
            first_token_time=group.first_token_time,
            finished_time=time.monotonic() if finished else None,
        )

    def _beam_completions(self, group: SequenceGroup) -> list[CompletionOutput]:
        """The n best finished beams, best first; for an aborted search, the n best running
        ones (finish reason "abort")."""
        params, search = group.params, group.beam
        if search.done:
            results = [
                (h.token_ids, h.cum_logprob, h.finish_reason, h.stop_reason)
                for h in search.best(params.n)
            ]
        else:
            running = zip(group.seqs, search.scores, strict=True)
            results = [(s.output_token_ids, score, "abort", None) for s, score in running]
            results = results[: params.n]
        completions = []
        for index, (token_ids, cum_logprob, reason, stop_reason) in enumerate(results):
            # (a beam ended by a stop token: its text left out, as a sampled sequence's)
            texted = (token_ids[:-1] if token_ids and stop_token_text_left_out(
                reason, stop_reason, params.include_stop_str_in_output) else token_ids)
            text = self._decode(group.seqs[0].prompt_token_ids, list(texted), params)
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(token_ids),
                    finish_reason=reason,
                    stop_reason=stop_reason,
                    cumulative_logprob=cum_logprob,
                    text_delta=text,
                    token_ids_delta=list(token_ids),
                    num_tokens=len(token_ids),
                )
            )
        return completions

    def _decode(self, prompt_token_ids: list[int], token_ids: list[int],
                params: SamplingParams) -> str:
        """A finished beam's text, detokenized as a streamed sequence's would be."""
        if not self.config.detokenize or self.tokenizer is None:
            return ""
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, [], skip_special_tokens=params.skip_special_tokens,
            decoder=self._token_decoder,
        )
        for token in token_ids:
            detokenizer.add_token(token)
        detokenizer.finish()
        return detokenizer.text

    def _sampled_completions(self, group: SequenceGroup, final: bool) -> list[CompletionOutput]:
        """What each sequence added since the request's previous output: O(new tokens), never
        a copy of everything so far. The final output also carries each whole completion
        (once per request)."""
        completions = []
        for seq in sorted(group.seqs, key=lambda s: s.index):
            if final:  # an aborted sequence's deferred text
                self._catch_up_text(seq)
            start = seq.num_prompt_tokens + seq.num_streamed_tokens
            new = seq.token_ids[start:]
            num_tokens = seq.num_output_tokens
            lp_delta = None
            if seq.logprobs is not None:
                lp_delta = seq.logprobs[seq.num_streamed_tokens :]
            completion = CompletionOutput(
                index=seq.index,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                text_delta="".join(seq.unstreamed_text),
                token_ids_delta=new,
                logprobs_delta=lp_delta,
                cumulative_logprob=seq.cumulative_logprob if lp_delta is not None else None,
                num_tokens=num_tokens,
            )
            seq.num_streamed_tokens = num_tokens
            seq.unstreamed_text.clear()
            if final:
                completion.text = seq.detokenizer.text if seq.detokenizer is not None else ""
                completion.token_ids = seq.output_token_ids
                completion.logprobs = seq.logprobs
            completions.append(completion)
        return completions

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured outputs for this model (the tokenizer is loaded on the first)."""
        return GrammarCompiler(self.model_config, self.model_config.vocab_size,
                               self.eos_token_ids, lambda: self.tokenizer)

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def watch_ranks(self, on_failure: Callable[[Exception], None]) -> None:
        """Under tensor parallelism, call on_failure (from another thread) when a worker rank
        dies while the engine may be idle; a step in flight fails by itself."""
        workers = getattr(self.runner, "workers", None)
        if workers is not None:
            workers.watch(on_failure)

    @property
    def tokenizer(self):
        """The model's tokenizer; None with skip_tokenizer_init."""
        if self._tokenizer is None and not self.config.skip_tokenizer_init:
            self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> None:
        if self.config.skip_tokenizer_init:
            return
        self._tokenizer = load_tokenizer(self.model_config)
        # Every detokenizer of this engine decodes through it (single tokens' texts kept).
        self._token_decoder = TokenDecoder(self._tokenizer)

    def _tokenizer_eos_token_id(self) -> int | None:
        """The tokenizer's EOS id: from its files when they say it plainly (no tokenizer
        load: tokenizer_eos.py), else from the tokenizer."""
        if self.config.skip_tokenizer_init:
            return None
        if self._tokenizer is None:
            token_id = read_eos_token_id(self.model_config)
            if token_id is not None:
                return token_id
        return self.tokenizer.eos_token_id

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one rank). Idempotent."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.pool
        # Free blocks are exactly those with refcount 0 (uncached or evictable), so this is
        # O(1) instead of a scan of the pool (the server refreshes its gauges while stepping).
        # Held by sequences: neither free nor idle-and-pinned (a pin holds a cached block,
        # not a running sequence).
        in_use = pool.num_blocks - pool.num_free_blocks - pool.policy.num_pinned_idle
        return EngineStats(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            kv_cache_usage=in_use / pool.num_blocks,
            num_running=self.scheduler.num_running_seqs(),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.counters.num_preemptions,
            num_steps=self.num_steps,
            num_pinned_blocks=pool.policy.num_pinned_idle,
            pin_budget_blocks=self.pin_budget.blocks,
            num_pinned_in_budget=pool.policy.num_pinned,
            num_pins_released=self.scheduler.counters.num_pins_released,
            num_waiting_prefill_tokens=self.scheduler.num_waiting_prefill_tokens(),
            num_prefill_deferrals=self.scheduler.counters.num_prefill_deferrals,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )

    def check_block_invariants(self) -> list[str]:
        """Problems with the pool and the tables (engine_service/core/invariants.py); when no
        request is live, also every block not free."""
        from engine_service.core.invariants import block_problems

        problems = block_problems(self)
        if not self._groups:
            if self.pool.num_free_blocks + self.pool.policy.num_pinned_idle != self.pool.num_blocks:
                problems.append(
                    f"no request is live but only {self.pool.num_free_blocks} of "
                    f"{self.pool.num_blocks} blocks are free"
                )
            if self.kv.num_free_cpu_blocks != self.kv.num_cpu_blocks:
                problems.append(
                    f"{self.kv.num_free_cpu_blocks} of {self.kv.num_cpu_blocks} CPU blocks free"
                )
            if self.sampler.token_counts.num_held:
                problems.append(f"no request is live but {self.sampler.token_counts.num_held} "
                                f"rows of penalty counts are held")
        return problems


def _ends_without_text(seq: Sequence, params) -> bool:
    """Whether a stop token (EOS, stop_token_ids: the caller checks), just appended, ends `seq`
    past min_tokens with its text left out (stop_token_text_left_out)."""
    return (seq.num_output_tokens >= params.min_tokens
            and not params.include_stop_str_in_output)
