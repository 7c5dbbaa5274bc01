"""Prompts of many lengths for parity tests (1 token to > 300 tokens)."""

PARAGRAPH = (
    "The history of computing is a story of abstractions built on abstractions. Early machines "
    "were programmed by rewiring panels; then came stored programs, assemblers, compilers, "
    "operating systems and networks, each hiding the layer below behind a simpler interface. "
)

TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def quicksort(items):\n    ",
    "List three colors of the rainbow:",
    "In 1969, the first humans walked on the Moon. Describe what they saw.",
    "Translate to French: The weather is nice today, so we will go to the park.",
    PARAGRAPH * 2 + "Summarize the paragraph above in one sentence.",
    PARAGRAPH * 6 + "What is the main idea?",
]


def parity_prompts(tokenizer) -> list[list[int]]:
    """Token-id prompts: a 1-token prompt, short and medium ones, and one of over 300 tokens."""
    prompts = [tokenizer.encode("Hello")[:1]] + [tokenizer.encode(t) for t in TEXTS]
    assert len(prompts[-1]) > 300, len(prompts[-1])
    return prompts
