"""The prompts the SmolLM2 import is checked on: English, code, digits, Unicode, a chat-like turn,
whitespace, and one text over 500 tokens."""

LONG = " ".join(
    f"Section {n}: attention lets every position of a sequence read every other position, weighted by "
    f"how well its query matches their keys; {n * 7} heads were studied, and {n + 3} of them mattered."
    for n in range(1, 14)
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "import torch\nx = torch.randn(3, 4)\nprint(x.",
    "SELECT name, age FROM users WHERE",
    "3 + 5 = 8, 12 * 12 = 144, 1024 / 32 =",
    "The year 1969: 20 July, 20:17 UTC, Apollo 11",
    "Pi is approximately 3.14159265358979",
    "Café, naïve, résumé, Ångström and façade",
    "日本語のテキストと中文的句子",
    "Emoji: 🙂 🚀 ∑ ∞ ≠ →",
    "Привет, как дела?",
    "  leading spaces\tand\ttabs\n\nand blank lines",
    "<html><body><p>Hello</p></body></html>",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Q: What is the boiling point of water at sea level?\nA:",
    "user: write a haiku about autumn\nassistant:",
    "To be, or not to be, that is the question:",
    "https://example.org/path?query=1&other=two#frag",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 3,
    LONG,
]
