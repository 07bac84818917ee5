"""Texts and conversations for tokenizer parity tests: hand-picked hard cases plus seeded random mixes."""

import random

HAND_PICKED = [
    "", " ", "  ", "\n", "\n\n", "\t", " \t \n ", "a", "Hello, world!", "hello world", " leading space",
    "trailing space ", "multiple   spaces   inside", "tabs\tand\ttabs", "line one\nline two\r\nline three",
    "café", "naïve résumé", "Straße", "façade", "Ångström", "ñandú", "Zażółć gęślą jaźń", "Привет, мир!",
    "中文", "你好，世界！", "日本語のテキスト", "한국어 문장", "😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🇫🇷🇯🇵",
    "❤\ufe0f", "🎉🎉🎉",
    "mixed 中文 and English 😀 together", "emoji👍in😀the🎉middle", "ＦＵＬＬＷＩＤＴＨ", "\u00a0non-breaking\u00a0space",
    "zero\u200bwidth", "combining e\u0301 accent", "ꙮ rare glyph", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "\ufffd replacement char", "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += i; }",
    "{\"key\": [1, 2, 3], \"ok\": true}", "https://example.com/path?query=1&b=2#frag", "user@example.com",
    "3.14159 2.71828 1e-5 -42 +7", "12345678901234567890",
    "I'm sure they'll say it's fine, we've done it, you'd agree", "ALL CAPS SENTENCE", "MiXeD cAsE", "...",
    "!!!???", "--- *** ___", "<html><body>x</body></html>",
    # SentencePiece-style edge cases: the "▁" prefix, whitespace runs, text that looks like a byte token.
    "  two leading spaces", "two trailing spaces  ", "\nleading newline", "trailing newline\n", "a\n\n\nb",
    "spaces then newline   \n  indented", " \n", "\n ", "literal <0x41> and <0xE4> byte-token text", "Ǆǅǆ ĳ ŉ ſ",
]

_PIECES = [
    "the", " the", " quick", " brown", " fox", "Hello", " world", ",", ".", "!", "?", "'s", " don't", "123",
    " 4567", "  ", "   ", "\t", "\n", "\n\n", " \n", "\r\n", "é", "ü", "ñ", "ç", "ø", "ß", " café", " über",
    "中", "文", "你好", "世界", "日本", "語", "한국", "😀", "🎉", "👍🏽", "👨\u200d👩\u200d👧", "🇯🇵", "❤\ufe0f", "∑", "π",
    "→", "def ", "return", "(", ")", "{", "}", "[]", "=", "==", "_", "-", "#", "//", "\\", "\"", "'",
]


def parity_texts(special_tokens: list[str], num_random: int = 200, seed: int = 1234) -> list[str]:
    """HAND_PICKED, special tokens inside text, and `num_random` seeded mixes of hard pieces."""
    rng = random.Random(seed)
    pieces = _PIECES + special_tokens
    texts = list(HAND_PICKED)
    texts += [f"before {token} after" for token in special_tokens]
    texts += ["".join(special_tokens), special_tokens[0] + "\n" + special_tokens[-1] + " text"]
    for _ in range(num_random):
        texts.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))))
    return texts


def conversations(special_token: str) -> list[list[dict]]:
    """Conversations that exercise roles, turns, unicode, whitespace, empty content and a name."""
    return [
        [{"role": "user", "content": "Hello!"}],
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3? 🤔"},
        ],
        [{"role": "user", "content": "  spaces and\n\nnewlines  \n"}],
        [{"role": "user", "content": "中文 café 😀 👨‍👩‍👧‍👦"}],
        [{"role": "user", "content": f"a special token {special_token} inside the text"}],
        [{"role": "user", "content": ""}],
        [{"role": "user", "content": "Who am I?", "name": "alice"}],
    ]
