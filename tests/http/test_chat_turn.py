"""vLLM's add_generation_prompt and continue_final_message on chat, /tokenize and /pin_prefix
(and gRPC's ChatMessages): the prompt is the one transformers renders for the same flags, a
continued message is generated from where it stops, and the two together, or a message the
template does not write as given, are 400s naming continue_final_message."""

from __future__ import annotations

import grpc
import pytest
from transformers import AutoTokenizer

from engine_service.model.tokenizer import FinalMessageError, render_chat
from pagedgen_api import generation_pb2 as pb
from tests.http.conftest import API_KEY

ASK = [{"role": "user", "content": "Name three colours."}]
BEGUN = [*ASK, {"role": "assistant", "content": "Red, green and"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_tokens(hf_tokenizer, messages: list[dict], **flags) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **flags)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def tokenize(http_engine, body: dict) -> tuple[int, dict]:
    return http_engine.call(f"{http_engine.base_url}/tokenize",
                            {"model": http_engine.model, **body}, API_KEY)


@pytest.mark.parametrize(("messages", "flags", "hf_flags"), [
    (ASK, {}, {"add_generation_prompt": True}),
    (ASK, {"add_generation_prompt": False}, {"add_generation_prompt": False}),
    (BEGUN, {"continue_final_message": True},  # (a lone continue: no new turn after it)
     {"add_generation_prompt": False, "continue_final_message": True}),
    (BEGUN, {"continue_final_message": True, "add_generation_prompt": False},
     {"add_generation_prompt": False, "continue_final_message": True}),
])
def test_the_prompt_is_what_transformers_renders_for_the_flags(http_engine, client,
                                                               hf_tokenizer, messages, flags,
                                                               hf_flags):
    expected = hf_tokens(hf_tokenizer, messages, **hf_flags)
    status, reply = tokenize(http_engine, {"messages": messages, **flags})
    assert status == 200, reply
    assert reply["tokens"] == expected
    chat = client.chat.completions.create(model=http_engine.model, messages=messages,
                                          max_tokens=2, temperature=0, extra_body=flags)
    assert chat.usage.prompt_tokens == len(expected)


def test_a_continued_message_is_generated_from_where_it_stops(http_engine, client,
                                                              hf_tokenizer):
    """The same greedy tokens as the rendered prompt sent as token ids; the reply holds the
    continuation alone (as vLLM's)."""
    prompt = hf_tokens(hf_tokenizer, BEGUN, add_generation_prompt=False,
                       continue_final_message=True)
    assert hf_tokenizer.decode(prompt).endswith("Red, green and")
    chat = client.chat.completions.create(
        model=http_engine.model, messages=BEGUN, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "ignore_eos": True})
    plain = client.completions.create(model=http_engine.model, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == plain.choices[0].text
    assert not chat.choices[0].message.content.startswith("Red")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/pin_prefix"])
def test_both_flags_true_are_a_400_naming_continue_final_message(http_engine, path):
    status, reply = http_engine.call(
        f"{http_engine.base_url}{path}",
        {"model": http_engine.model, "messages": BEGUN, "add_generation_prompt": True,
         "continue_final_message": True}, API_KEY)
    assert status == 400, reply
    assert reply["error"]["param"] == "continue_final_message"
    assert reply["error"]["message"].startswith(
        "continue_final_message must be false when add_generation_prompt is true")


def test_continuing_needs_messages(http_engine):
    status, reply = tokenize(http_engine, {"prompt": "Hi", "continue_final_message": True})
    assert status == 400 and reply["error"]["param"] == "continue_final_message", reply
    # add_generation_prompt means nothing to a text prompt: not refused there (as before).
    status, reply = tokenize(http_engine, {"prompt": "Hi", "add_generation_prompt": False})
    assert status == 200 and reply["count"] > 0, reply


def test_grpc_takes_the_flags_on_chat_messages(http_engine, engine_stub, hf_tokenizer):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                     for m in BEGUN], continue_final_message=True)
    reply = engine_stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60)
    assert list(reply.token_ids) == hf_tokens(hf_tokenizer, BEGUN, add_generation_prompt=False,
                                              continue_final_message=True)
    chat.add_generation_prompt = True
    with pytest.raises(grpc.RpcError) as refused:
        engine_stub.Generate(pb.GenerateRequest(chat=chat), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("chat.continue_final_message must be false")


def test_a_message_the_template_does_not_write_as_given_cannot_be_continued(hf_tokenizer):
    """transformers' error holds the whole rendered chat; ours says what is wrong."""
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_tokenizer.name_or_path)
    hf_tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: "
                                  "{{ m['content'] | upper }}\n{% endfor %}")
    with pytest.raises(FinalMessageError, match="leaves it out or changes it"):
        render_chat(hf_tokenizer, BEGUN, add_generation_prompt=False,
                    continue_final_message=True)
    # ... and upper-case content is written as given: continued.
    shouted = [*ASK, {"role": "assistant", "content": "RED, GREEN AND"}]
    assert render_chat(hf_tokenizer, shouted, add_generation_prompt=False,
                       continue_final_message=True).endswith("assistant: RED, GREEN AND")
