"""servegate.yaml: every backend kind builds its adapter; mistakes are named with their place."""

from __future__ import annotations

import pytest

from gateway.config import load_backends


def test_each_kind_builds_its_adapter(tmp_path):
    path = tmp_path / "servegate.yaml"
    path.write_text("""backends:
  - {name: a, kind: vllm, url: "http://10.0.0.1:8000", model: m1}
  - {name: b, kind: sglang, url: "http://10.0.0.2:30000", model: m2, served_name: fast}
  - {name: c, kind: tgi, url: "http://10.0.0.3:80", model: m3}
  - {name: d, kind: llama-server, url: "http://10.0.0.4:8080", model: m4}
  - {name: e, kind: llama-cpp, served_name: edge, options: {slots: 2}}
  - {name: f, kind: openai, url: "http://10.0.0.6:9000", model: m6, options: {max_context: 8192}}
  - {name: g, kind: trtllm, url: "http://10.0.0.7:8000", model: m7}
  - {name: h, kind: ollama, url: "http://10.0.0.8:11434", model: "llama3.2:1b"}
  - {name: i, kind: lmdeploy, url: "http://10.0.0.9:23333", model: m9}
  - {name: j, kind: xinference, url: "http://10.0.0.10:9997", model: qwen2.5-instruct}
""")
    built = load_backends(path)
    assert {k: type(v).__name__ for k, v in built.items()} == {
        "m1": "VLLMBackend", "fast": "SGLangBackend", "m3": "TGIBackend", "m4": "LlamaCppServerBackend",
        "edge": "LlamaCppBackend", "m6": "OpenAICompatBackend", "m7": "ProfileBackend", "llama3.2:1b": "ProfileBackend",
        "m9": "ProfileBackend", "qwen2.5-instruct": "ProfileBackend"}
    assert built["m4"].config.health_path == "/health" and built["m6"].config.max_context == 8192
    assert built["llama3.2:1b"].config.health_path == "/api/version" and built["m7"].config.runtime == "trtllm"
    assert built["qwen2.5-instruct"].config.health_path == "/status"


@pytest.mark.parametrize("text, message", [
    ("backends:\n  - {name: a, kind: nope, url: x, model: m}\n", "backends.0.kind"),
    ("backends:\n  - {name: a, kind: vllm, model: m}\n", "needs `url` and `model`"),
    ("backends:\n  - {name: a, kind: vllm, url: x, model: m}\n  - {name: b, kind: tgi, url: y, model: m}\n",
     "two backends serve the model 'm'"),
    ("backends:\n  - {name: a, kind: vllm, url: x, model: m}\n  - {name: a, kind: tgi, url: y, model: n}\n",
     "two backends are named 'a'"),
    ("backends:\n  - {name: a, kind: vllm, url: x, model: m, colour: red}\n", "backends.0.colour"),
])
def test_mistakes_are_named(tmp_path, text, message):
    path = tmp_path / "servegate.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_backends(path)
