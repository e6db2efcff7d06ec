"""The support matrices against the runtimes' released code: every checked cell agrees with the last
derivation (policies.drift), the checks themselves work, and the cells a review found wrong read
as their code does."""

from __future__ import annotations

import textwrap

import pytest

from advisor.advise import Workload, advise
from advisor.hardware import resolve as hardware
from advisor.model_facts import resolve
from policies.drift import DERIVED, ProbeError, derive, drift, load_derived, run_probe
from policies.matrix import HARDWARE_FAMILIES, Cell, Probe, matrices


def test_every_checked_cell_agrees_with_the_code_of_the_release_it_was_read_at():
    for runtime, m in matrices().items():
        if not m.release:
            continue
        derived = load_derived(runtime)
        assert derived, f"{runtime}: no derivation in {DERIVED} (run python -m policies.drift)"
        assert drift(m, derived) == [], runtime
        text = (DERIVED / f"{runtime}.yaml").read_text()
        for release in m.release:  # the output names the releases the matrix names
            assert (release.pip or f"{release.git}@{release.ref}") in text, runtime


def test_every_runtime_matrix_names_its_release_and_cites_code_for_its_cells():
    for runtime, m in matrices().items():
        if runtime == "builtin":  # servegate's own engine: its cells cite this tree's code
            assert all(c.line for _, c in m.cells()), runtime
            continue
        assert m.release, f"{runtime}: no release to re-derive its cells from"
        cited = sum(bool(c.line) for _, c in m.cells())
        checked = sum(bool(c.code) for _, c in m.cells())
        assert cited >= 0.6 * len(list(m.cells())) and checked >= 10, (runtime, cited, checked)


def test_a_cell_edited_against_its_code_is_drift():
    m = matrices()["vllm"]
    derived = load_derived("vllm")
    awq = m.weight_quant["awq"]
    assert drift(m, derived) == []
    m.weight_quant["awq"] = awq.model_copy(update={"hardware": ["nvidia-*"], "not_on": ["amd-*"]})
    try:
        problems = drift(m, derived)
    finally:
        m.weight_quant["awq"] = awq
    assert any("weight_quant.awq on amd-cdna3: the code says yes" in p and "rocm.py" in p for p in problems)


def test_a_check_added_without_rederiving_is_drift():
    m = matrices()["sglang"]
    cell = m.features["openai_api"]
    extra = Probe(file="sglang/srt/entrypoints/http_server.py", families=["nvidia-*"], matches="v1/chat")
    m.features["openai_api"] = cell.model_copy(update={"code": [*cell.code, extra]})
    try:
        problems = drift(m, load_derived("sglang"))
    finally:
        m.features["openai_api"] = cell
    assert any("features.openai_api" in p for p in problems)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "platform.py").write_text(textwrap.dedent('''
        from typing import Literal
        KVDType = Literal["auto", "fp8_e4m3", "int8"]
        METHODS = {"awq": 1, "gptq": 2}

        class Rocm:
            supported_quantization: list[str] = ["awq", "fp8"]

        class Xpu:
            supported_quantization = ("gptq",)

        class Mxfp4Config:
            @classmethod
            def get_min_capability(cls) -> int:
                return 80
    '''))
    (tmp_path / "pkg" / "arch.cpp").write_text('{ LLM_ARCH_QWEN3, "qwen3" },\n')
    return tmp_path


def test_each_kind_of_check_reads_the_line_it_cites(tree):
    verdicts, found = run_probe(Probe(file="pkg/platform.py", families=["amd-*"], listed="supported_quantization",
                                      has="awq", within="Rocm"), tree)
    assert set(verdicts.values()) == {True} and set(verdicts) == {f for f in HARDWARE_FAMILIES if f.startswith("amd")}
    assert found.line == "pkg/platform.py:7"
    verdicts, _ = run_probe(Probe(file="pkg/platform.py", families=["intel-xpu"], listed="supported_quantization",
                                  has="awq", within="Xpu"), tree)
    assert verdicts == {"intel-xpu": False}
    assert run_probe(Probe(file="pkg/platform.py", families=["nvidia-*"], listed="KVDType", has="int8"), tree)[1].holds
    assert run_probe(Probe(file="pkg/platform.py", families=["nvidia-*"], listed="METHODS", has="gptq"), tree)[1].holds
    verdicts, found = run_probe(Probe(file="pkg/platform.py", families=["nvidia-*"], min_capability="Mxfp4Config"),
                                tree)
    assert not verdicts["nvidia-turing"] and verdicts["nvidia-ampere"] and verdicts["nvidia-blackwell"]
    assert found.line == "pkg/platform.py:15 (>= 80)"
    verdicts, found = run_probe(Probe(file="pkg/arch.cpp", families=["cpu-x86"], matches=r"LLM_ARCH_QWEN3\b"), tree)
    assert verdicts == {"cpu-x86": True} and found.line == "pkg/arch.cpp:1"


@pytest.mark.parametrize("probe, message", [
    (Probe(file="pkg/missing.py", families=["cpu-x86"], matches="x"), "no such file"),
    (Probe(file="pkg/platform.py", families=["amd-*"], listed="supported_quantization", has="awq"),
     "assigned 2 times"),
    (Probe(file="pkg/platform.py", families=["amd-*"], listed="supported_quantization", has="awq", within="Cuda"),
     "no class Cuda"),
    (Probe(file="pkg/platform.py", families=["nvidia-*"], min_capability="AwqConfig"), "no AwqConfig"),
])
def test_a_check_that_no_longer_finds_what_it_reads_says_so(tree, probe, message):
    with pytest.raises(ProbeError, match=message):
        run_probe(probe, tree)


def test_a_cell_reads_unknown_where_its_source_does_not_cover_a_family():
    cell = Cell(status="yes", source="X", hardware=["nvidia-*"], not_on=["amd-*"])
    assert cell.on("nvidia-hopper") == "yes" and cell.on("amd-cdna3") == "no" and cell.on("intel-gaudi") == "unknown"
    assert Cell(status="partial", source="X").on("apple-metal") == "partial"


def test_derive_unions_the_checks_of_a_cell(tree):
    class OneCell:
        def cells(self):
            yield "weight_quant.awq", Cell(status="yes", source="X", code=[
                Probe(file="pkg/platform.py", families=["amd-*"], listed="supported_quantization", has="awq",
                      within="Rocm"),
                Probe(file="pkg/platform.py", families=["nvidia-*"], min_capability="Mxfp4Config")])

    said = derive(OneCell(), tree)["weight_quant.awq"]
    assert "amd-cdna3" in said["yes"] and "nvidia-ampere" in said["yes"] and "nvidia-turing" in said["no"]
    assert "intel-gaudi" not in said["yes"] + said["no"]  # not covered: no verdict
    assert said["lines"] == ["pkg/platform.py:7", "pkg/platform.py:15 (>= 80)"]


# -- the cells a review of the runtimes' code found wrong, as they read now -----------------------
def _on(runtime: str, path: str, family: str) -> str:
    m = matrices()[runtime]
    section, key = path.split(".")
    return getattr(m, section)[key].on(family)


@pytest.mark.parametrize("runtime, path, family, status", [
    ("vllm", "weight_quant.awq", "amd-cdna3", "yes"),  # platforms/rocm.py supported_quantization
    ("vllm", "weight_quant.gptq", "amd-cdna3", "yes"),
    ("vllm", "weight_quant.awq", "nvidia-blackwell", "yes"),  # AWQ Marlin has no upper capability bound
    ("vllm", "weight_quant.int8_w8a8", "nvidia-blackwell", "yes"),
    ("vllm", "weight_quant.awq", "google-tpu", "yes"),  # tpu-inference lists auto_awq
    ("vllm", "weight_quant.fp8", "google-tpu", "yes"),
    ("vllm", "weight_quant.mxfp4", "nvidia-turing", "no"),  # Mxfp4Config.get_min_capability() is 80
    ("vllm", "weight_quant.mxfp4", "apple-metal", "no"),
    ("vllm", "kv_cache.int8", "nvidia-ampere", "yes"),  # int8_per_token_head through Triton attention
    ("sglang", "weight_quant.nvfp4", "nvidia-turing", "no"),  # ModelOptFp4Config: capability 80 and up
    ("sglang", "weight_quant.nvfp4", "nvidia-blackwell", "yes"),
    ("tgi", "weight_quant.fp8", "nvidia-ampere", "yes"),  # GPTQMarlinFP8Linear on capability 8.x
    ("tgi", "weight_quant.fp8", "amd-cdna3", "yes"),  # e4m3fnuz on ROCm
    ("ollama", "weight_quant.mxfp4", "apple-metal", "yes"),
    ("llama-cpp", "weight_quant.nvfp4", "apple-metal", "no"),  # Metal's supports_op refuses NVFP4
])
def test_cells_read_as_the_runtimes_code_decides(runtime, path, family, status):
    assert _on(runtime, path, family) == status


def test_the_matrices_are_at_the_current_releases():
    m = matrices()
    assert (m["vllm"].version, m["sglang"].version, m["lmdeploy"].version) == ("0.34.0", "0.5.23", "0.18.0")
    assert m["vllm"].weight_quant["gguf"].status == "no"  # neither a load format nor a method in 0.34.0


@pytest.mark.slow
def test_gguf_type_names_and_framework_dtypes_are_one_vocabulary():
    """A GGUF F16 file is fp16 weights: llama.cpp on a Mac loads it as it loads fp16."""
    mac, model = hardware("m3-max"), resolve("Qwen/Qwen2.5-7B-Instruct")
    for name in ("F16", "fp16", "BF16"):
        llama = next(c for c in advise(model, mac, 1, Workload(weight_quant=name, concurrency=1)).candidates
                     if c.runtime == "llama-cpp")
        assert llama.verdict != "excluded", (name, llama.reasons)


def test_an_uncovered_family_is_a_warning_not_an_exclusion():
    """vLLM's code says nothing of NVFP4 on Gaudi (an out-of-tree plugin): unknown, flagged, not excluded."""
    assert _on("vllm", "weight_quant.nvfp4", "intel-gaudi") == "unknown"
    report = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("gaudi3"), 1, Workload(weight_quant="nvfp4"))
    vllm = next(c for c in report.candidates if c.runtime == "vllm")
    fired = {r["rule"]: r for r in vllm.reasons}
    assert "weight-format-not-loadable" not in fired or fired["weight-format-not-loadable"]["kind"] != "exclude"
    assert fired["unknown-weight-format"]["cell"]["status"] == "unknown"
