"""Loading a model's tokenizer, with an error that says what is missing.

Without tokenizer files transformers tries to convert a slow tokenizer and fails with a message
about sentencepiece or tiktoken, which tells a user nothing about their directory. We look for
the files first. `skip_tokenizer_init` (as in vLLM) serves token ids only.
"""

import json
from pathlib import Path

from engine_service.model.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class TokenizerNotFoundError(ValueError):
    pass


def load_tokenizer(model_config: ModelConfig):
    """The model's HF tokenizer (a GGUF file carries its own)."""
    path = Path(model_config.path)
    if model_config.gguf_file is None:
        present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
        # tokenizer_config.json alone names a class but holds no vocabulary.
        if not [name for name in present if name != "tokenizer_config.json"]:
            raise TokenizerNotFoundError(
                f"model directory {path} has no tokenizer: looked for "
                f"{', '.join(TOKENIZER_FILES[:3])}; add the tokenizer files, or serve token ids "
                f"only with skip_tokenizer_init=True (--skip-tokenizer-init)"
            )
    try:
        if model_config.gguf_file is None and _names_the_tokenizers_backend(path):
            # What AutoTokenizer resolves such a directory to, without its import of most of
            # transformers (~3 s of CPU per load; tests/engine/test_config_json.py compares).
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, gguf_file=model_config.gguf_file)
    except (OSError, ValueError) as error:
        raise TokenizerNotFoundError(
            f"could not load the tokenizer of {path / (model_config.gguf_file or '')}: {error}; "
            f"or serve token ids only with skip_tokenizer_init=True (--skip-tokenizer-init)"
        ) from None


def _names_the_tokenizers_backend(path: Path) -> bool:
    """tokenizer_config.json names transformers' generic fast tokenizer, with no custom code,
    for a Llama checkpoint (AutoTokenizer overrides the named class for some model types,
    Qwen2's and Mistral's among them)."""
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (isinstance(tokenizer_config, dict)
            and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config
            and model_type == "llama"
            and (path / "tokenizer.json").is_file())


def encode_text(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids (the tokenizer's special tokens added, e.g. BOS)."""
    return tokenizer.encode(text)


# apply_chat_template's own arguments, the names the template is given for them and the
# functions it is given (raise_exception, strftime_now): not template variables a request may
# set (tokenize=True would return ids, chat_template would
# swap the template).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "add_special_tokens", "conversations", "self", "sanitize_control_tokens",
    "raise_exception", "strftime_now",
})


def render_chat(tokenizer, conversation: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The model's chat template applied, ready for the assistant's turn
    (`add_generation_prompt`), or ending with the last message's content, for the model to
    continue (`continue_final_message`, transformers'; FinalMessageError when the template does
    not write that content whole); `tools`: the tools the model may call (a template without a
    place for them leaves them out); `template_kwargs`: more variables for the template
    (check_template_kwargs first)."""
    try:
        return tokenizer.apply_chat_template(with_argument_objects(conversation), tools=tools,
                                             tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             **(template_kwargs or {}))
    except ValueError as error:
        # (transformers' own message holds the whole rendered chat)
        if continue_final_message and "continue_final_message" in str(error):
            raise FinalMessageError(
                "continue_final_message needs the last message's content, whole, in the chat "
                "the model's template writes, and this template leaves it out or changes "
                "it") from None
        raise


class FinalMessageError(ValueError):
    """The last message cannot be continued: the chat template does not write it as given."""


def chat_turn_error(add_generation_prompt: bool | None, continue_final_message: bool,
                    field: str = "continue_final_message") -> str | None:
    """Why the two cannot go together (a message naming `field`), or None: a message left
    open for the model has no assistant's turn after it."""
    if continue_final_message and add_generation_prompt:
        return (f"{field} must be false when add_generation_prompt is true (the last message "
                f"is continued, or a new assistant's turn opened, not both), got true: set "
                f"add_generation_prompt to false, or leave it unset")
    return None


def template_kwargs_error(kwargs: object, field: str) -> str | None:
    """Why `kwargs` cannot be the template's extra variables (a message naming `field`), or
    None when it can: a dict of string names, none of them RESERVED_TEMPLATE_KWARGS."""
    if not isinstance(kwargs, dict):
        return f"{field} must be a JSON object of template variables, got a " \
               f"{type(kwargs).__name__}"
    reserved = sorted(k for k in kwargs if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        return (f"{field} must not set {', '.join(map(repr, reserved))}: the chat template "
                f"call's own arguments (reserved: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})")
    odd = [k for k in kwargs if not isinstance(k, str) or not k.isidentifier()]
    if odd:
        return f"{field} names must be identifiers, got {odd[0]!r}"
    return None


def with_argument_objects(conversation: list[dict]) -> list[dict]:
    """Each tool call's arguments as an object where its text parses as one: templates write
    them with `tojson`, which would quote the text (OpenAI's clients send the text)."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls and isinstance(calls, list):
            message = {**message, "tool_calls": [_with_object(call) for call in calls]}
        out.append(message)
    return out


def _with_object(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def encode_rendered_chat(tokenizer, rendered: str) -> list[int]:
    # The template already holds the special tokens (the offline LLM.chat does the same).
    return tokenizer.encode(rendered, add_special_tokens=False)
