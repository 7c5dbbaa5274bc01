"""Logprobs of a prompt's own tokens (vLLM's prompt_logprobs; OpenAI's echo with logprobs).

Prompt token i is scored by the logits at position i - 1, which only the prefill chunk that
computes that position has: the runner adds those rows to the ones it samples from
(ModelRunner.step_inputs), and the engine scores them here, after the forward, before sampling.
"""

import torch

from engine_service.model.token_logprobs import TokenLogprobs

# Rows scored at a time: each row's temporaries (logsumexp's, the comparison mask) are
# vocabulary-sized.
ROWS_PER_SLICE = 256


def score_tokens(logits: torch.Tensor, token_ids: list[int],
                 num_tops: list[int]) -> list[TokenLogprobs]:
    """Row r of `logits` [rows, vocab] scores token_ids[r]: its logprob under the raw
    distribution, its rank, and the num_tops[r] most likely tokens (with it). One copy to the
    host for the whole batch."""
    if not token_ids:
        return []
    targets = torch.tensor(token_ids, device=logits.device, dtype=torch.long).unsqueeze(1)
    num_top = max(num_tops)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for start in range(0, len(token_ids), ROWS_PER_SLICE):
        # logprob = logit - logsumexp(row): read off the logits (no log-softmaxed copy of the
        # rows), which rank the tokens as their logprobs do.
        rows = logits[start : start + ROWS_PER_SLICE].float()
        log_total = rows.logsumexp(dim=-1, keepdim=True)
        target_logits = rows.gather(1, targets[start : start + ROWS_PER_SLICE])
        chosen.append((target_logits - log_total).squeeze(1))
        ranks.append((rows > target_logits).sum(dim=-1) + 1)
        if num_top:
            values, ids = rows.topk(num_top, dim=-1)
            top_values.append((values - log_total).flatten())
            top_ids.append(ids.flatten())
    parts = [torch.cat(chosen).double(), torch.cat(ranks).double()]
    if num_top:
        parts += [torch.cat(top_values).double(), torch.cat(top_ids).double()]
    # Token ids and ranks are exact in float64: one transfer, then plain lists.
    host = torch.cat(parts).tolist()
    num_rows = len(token_ids)
    values_at, ids_at = 2 * num_rows, 2 * num_rows + num_rows * num_top
    scored = []
    for r, (token, k) in enumerate(zip(token_ids, num_tops, strict=True)):
        row = r * num_top
        top = {int(t): v for t, v in zip(host[ids_at + row : ids_at + row + k],
                                         host[values_at + row : values_at + row + k],
                                         strict=True)}
        top[token] = host[r]
        scored.append(TokenLogprobs(token, host[r], top, int(host[num_rows + r])))
    return scored
