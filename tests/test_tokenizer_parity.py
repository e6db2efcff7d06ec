"""The engine tokenizes as the model's own runtime does: for the default GGUF, its token ids equal
llama.cpp's tokenizer (llama-cpp-python, `vocab_only`), and the converted directory gives the same
ids on every transformers release servegate supports and in vLLM's CPU build."""

from __future__ import annotations

import json
import random
import subprocess

import pytest

from backends import peers
from backends.builtin.worker.loader import default_model_path, load_tokenizer

from .conftest import provisioned_or_skip

pytestmark = pytest.mark.slow

CODE = [
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "const add = (a, b) => a + b;\nexport default add;", "#include <stdio.h>\nint main(void) { return 0; }",
    'SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;', "if [ -f ~/.bashrc ]; then . ~/.bashrc; fi",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}', "<div class=\"x\">Hello &amp; bye</div>",
    "fn main() {\n\tprintln!(\"{}\", 42);\n}", "x = [i*i for i in range(10) if i % 2 == 0]",
    "import numpy as np\narr = np.zeros((3, 4), dtype=np.float32)", "git commit -m 'fix: off-by-one in parser'",
    "    indented by four\n        and by eight", "a_b__c___d", "camelCaseAndPascalCase", "snake_case_var = 1_000_000",
    "0x1F 0b1010 0o777 1e-9 3.14159", "// comment\n/* block */", "@decorator\nclass A(B, metaclass=M): pass",
    "lambda *args, **kwargs: None", "::std::vector<std::string>", "$HOME/${USER}/$(pwd)", "a != b && c <= d || !e",
    "```python\nprint('hi')\n```", "<|endoftext|> is not code", "#!/usr/bin/env python3", "%d %s %5.2f %%",
    "re.compile(r'^\\s*(\\d+)\\.(\\d+)$')", "key=value; other=thing", "<?xml version=\"1.0\"?>",
]
MULTILINGUAL = [
    "Le cœur a ses raisons que la raison ne connaît point.", "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "¿Dónde está la biblioteca? ¡Allí!", "Привет, как дела? Всё хорошо.", "東京タワーは高いです。",
    "我爱自然语言处理。",
    "안녕하세요, 만나서 반갑습니다.", "مرحبا بالعالم، كيف حالك؟", "नमस्ते दुनिया", "שלום עולם", "สวัสดีชาวโลก",
    "Γειά σου Κόσμε", "Merhaba dünya, nasılsın?", "Xin chào thế giới", "Witaj świecie, zażółć gęślą jaźń",
    "Hej världen, smörgåsbord", "Olá mundo, ação e coração", "Ciao mondo, perché così?", "Halo dunia",
    "Habari dunia", "Բարեւ աշխարհ", "გამარჯობა სამყარო", "Сәлем әлем", "Здраво свете", "Tere maailm",
    "Labas pasauli", "Sveika pasaule", "Dia dhuit a dhomhain", "Helló világ, árvíztűrő tükörfúrógép",
    "日本語とEnglishのmixed text", "emoji: 🚀🔥👍🏽 👨‍👩‍👧‍👦 🇫🇷", "∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ",
]
WHITESPACE = [w.join(["alpha", "beta", "gamma"]) for w in
              [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\n\n\n", "\r\n", " \n", "\n ", " \t ", "\u00a0",
               "\u3000", "\u2003", "    \n    ", "\n\t\n", " \r\n \r\n ", "\x0b", "\x0c"]] + [
    " ", "  ", "\n", "\t", "   leading", "trailing   ", " both ", "\n\nparagraph\n\n", "a" + " " * 17 + "b",
    "tab\tseparated\tvalues", "line1\nline2\r\nline3\rline4",
]
NUMBERS = ["0", "7", "42", "123", "1234", "12345", "123456789", "3.14", "-2.5e10", "1,000,000", "2026-12-01",
           "12:34:56", "+1 (555) 010-9999", "v1.2.3", "100%", "$19.99", "€5", "½ ¼ ¾", "١٢٣", "一二三", "4K60fps",
           "x1y2z3", "0001", "9" * 40]
PUNCTUATION = ["I'm", "you're", "we'll", "they'd", "it's", "She'S", "DON'T", "rock'n'roll", "...", "?!?!", "—–-",
               "«quoted»", "“smart” ‘quotes’", "(paren) [bracket] {brace}", "a.b,c;d:e", "e-mail", "U.S.A.",
               "Hello, World!", "HELLO world", "hElLo WoRlD"]
UNICODE_EDGE = ["e\u0301", "ñ vs n\u0303", "\u200bzero\u200bwidth", "\ufeffBOM", "\u202eRTL override",
                "fullwidth ＡＢＣ１２３", "ligature ﬁ ﬂ", "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\U0001f600\U0001f601", "a\u0000b",
                "control\u0007bell", "ǅ ǆ Ǆ", "İstanbul ı", "ß ẞ", "Ω Ω", "ℌ ℍ", "\u2028line sep", "dev\u0928\u093f"]


def special_texts(tokens: list[str], types: list[int]) -> list[str]:
    """Each control or user-defined token of the vocabulary inside text, as prompts carry them."""
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind in (3, 4)]
    shapes = ["{t}", "x{t}y", " {t} ", "{t}\nhello", "hi{t}{t}", "<{t}>"]
    return [shapes[i % len(shapes)].format(t=t) for i, t in enumerate(specials)] + [
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "<|im_start|", "|im_end|>", "<|im_end",
    ]


def corpus(tokens: list[str], types: list[int]) -> list[str]:
    fixed = CODE + MULTILINGUAL + WHITESPACE + NUMBERS + PUNCTUATION + UNICODE_EDGE + special_texts(tokens, types)
    rng = random.Random(0)  # mixes of the above, cut anywhere
    mixed = ["".join(rng.choice(fixed)[rng.randrange(8):][:rng.randrange(4, 40)] for _ in range(rng.randrange(2, 6)))
             for _ in range(60)]
    return fixed + mixed


@pytest.fixture(scope="module")
def gguf():
    from gguf import GGUFReader

    reader = GGUFReader(default_model_path())
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    return field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"), field("tokenizer.ggml.add_bos_token")


@pytest.fixture(scope="module")
def texts(gguf) -> list[str]:
    texts = corpus(gguf[0], gguf[1])
    assert len(texts) >= 200 and len(set(texts)) >= 200
    return texts


@pytest.fixture(scope="module")
def engine_ids(default_model_dir, texts) -> list[list[int]]:
    tokenizer = load_tokenizer(default_model_dir)  # what the engine loads
    return [tokenizer.encode(text) for text in texts]


def differences(texts, expected, got) -> list[str]:
    return [f"{text!r}: {a} != {b}" for text, a, b in zip(texts, expected, got, strict=True) if a != b][:5]


def test_the_engine_tokenizes_as_llama_cpp_does(gguf, texts, engine_ids):
    from llama_cpp import Llama

    from backends.cpu import llama_cpp_safe

    llama_cpp_safe()
    vocab = Llama(str(default_model_path()), vocab_only=True, verbose=False)
    # Special tokens in text are parsed, as llama-server does with prompts; BOS as the GGUF says.
    theirs = [vocab.tokenize(text.encode(), add_bos=bool(gguf[2]), special=True) for text in texts]
    assert not differences(texts, theirs, engine_ids)


def test_a_completion_prompt_gets_no_bos_the_gguf_does_not_ask_for(default_model_dir, gguf):
    """transformers 4.57's own GGUF conversion prefixed every prompt with <|im_start|>: 7 tokens
    where llama.cpp and vLLM count 6."""
    ids = load_tokenizer(default_model_dir).encode("The three laws of thermodynamics are")
    assert not gguf[2] and len(ids) == 6 and ids[0] != 1


@pytest.mark.parametrize("environment", ["transformers4", "vllm"])
def test_the_converted_directory_tokenizes_alike_everywhere(environment, default_model_dir, texts, engine_ids,
                                                            tmp_path):
    python = provisioned_or_skip(peers.transformers4_python if environment == "transformers4" else peers.vllm_python)
    path = tmp_path / "corpus.json"
    path.write_text(json.dumps(texts))
    command = [str(python), "tests/tokenize_corpus.py", str(default_model_dir), str(path)]
    if environment == "vllm":
        command.append("--vllm")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=peers.vllm_env() | {
        "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert not differences(texts, engine_ids, answer["ids"]), answer["version"]
