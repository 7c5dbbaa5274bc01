"""The engine's message limit holds the largest request its validator accepts: a context's text
prompt with allowed_token_ids and bad_words at their largest (a whole vocabulary of ids was
past the limit of a 2,048-token engine: RESOURCE_EXHAUSTED naming no field)."""

from __future__ import annotations

import pytest

from engine_service.model.bad_words import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from engine_service.model.sampling_params import MAX_ALLOWED_TOKEN_IDS
from engine_service.serving.connection_limits import generation_request_bytes
from engine_service.serving.validation import CHARS_PER_CONTEXT_TOKEN
from pagedgen_api import generation_pb2 as pb


@pytest.mark.parametrize("context", [512, 2048, 32768])
def test_the_largest_accepted_request_fits_the_message_limit(context):
    request = pb.GenerateRequest(request_id="r" * 128, text="\U0001f600" * (
        CHARS_PER_CONTEXT_TOKEN * context))
    request.sampling.allowed_token_ids.extend([2**31 - 1] * MAX_ALLOWED_TOKEN_IDS)
    request.sampling.bad_words.extend(["\U0001f600" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS)
    assert request.ByteSize() <= generation_request_bytes(context)
