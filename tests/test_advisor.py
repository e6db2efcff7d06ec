"""`servegate advise`: support matrices, rules, capacity model and the report."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from typer.testing import CliRunner

from advisor.advise import ImpossibleRequest, Workload, advise
from advisor.capacity import MissingArchitectureField, estimate_params
from advisor.hardware import UnknownHardware
from advisor.hardware import catalogue as catalogue_devices
from advisor.hardware import resolve as hardware
from advisor.model_facts import UnknownModel, catalogue, resolve
from advisor.report import to_html, to_json, to_markdown
from gateway.cli import app
from policies.matrix import HARDWARE_FAMILIES, MATRICES, load_matrix, matrices
from policies.rules import RULES, RuleError, RuleSet

RUNTIMES = {"vllm", "sglang", "tgi", "llama-cpp", "tensorrt-llm", "ollama", "lmdeploy", "mlx", "builtin"}


# -- support matrices -------------------------------------------------------------------------
def test_every_runtime_has_a_matrix_and_every_cell_a_status_source_and_date():
    loaded = matrices()
    assert set(loaded) == RUNTIMES
    for m in loaded.values():
        assert set(m.hardware) == set(HARDWARE_FAMILIES)
        for path, cell in m.cells():
            assert cell.status in ("yes", "no", "partial", "unverified", "unknown"), path
            source = m.sources[cell.source]  # resolves, or loading would have failed
            assert source.ref and cell.checked, f"{m.runtime} {path}"


def _matrix_with(tmp_path, edit):
    """vLLM's matrix as a file, after `edit` changed its parsed YAML."""
    data = yaml.safe_load((MATRICES / "vllm.yaml").read_text())
    edit(data)
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_cell_without_a_source_is_refused(tmp_path):
    with pytest.raises(ValueError, match="a one-line cell reads"):
        load_matrix(_matrix_with(tmp_path, lambda d: d["hardware"].update({"nvidia-turing": "yes"})))
    with pytest.raises(ValueError, match="source"):
        load_matrix(_matrix_with(tmp_path, lambda d: d["weight_quant"]["awq"].pop("source")))
    with pytest.raises(ValueError, match="source 'V99' is not among this file's sources"):
        load_matrix(_matrix_with(tmp_path, lambda d: d["hardware"].update({"nvidia-turing": "yes V99"})))


def test_a_matrix_must_answer_for_every_hardware_family(tmp_path):
    with pytest.raises(ValueError, match="missing: \\['nvidia-turing'\\]"):
        load_matrix(_matrix_with(tmp_path, lambda d: d["hardware"].pop("nvidia-turing")))
    with pytest.raises(ValueError, match="matches no family"):
        load_matrix(_matrix_with(tmp_path, lambda d: d["weight_quant"]["awq"].update({"not_on": ["intel-gpu"]})))
    with pytest.raises(ValueError, match="a probe is one of"):
        load_matrix(_matrix_with(tmp_path, lambda d: d["weight_quant"]["awq"]["code"][0].pop("min_capability")))


# -- catalogues and the capacity model ----------------------------------------------------------
def test_kv_bytes_per_token_of_catalogue_models_are_exact():
    from advisor.capacity import kv_bytes_per_token

    def kv(model: str) -> float:
        return kv_bytes_per_token(resolve(model).arch)

    assert kv("meta-llama/Llama-3.1-70B-Instruct") == 327_680
    assert kv("Qwen/Qwen3-32B") == 262_144  # its head_dim 128, not 5120 / 64
    assert kv("deepseek-ai/DeepSeek-V3") == 70_272  # MLA latent + rope key, not the 128 KV heads


def test_parameters_derived_from_configs_match_the_published_counts():
    for model, entry in catalogue()["models"].items():
        if entry["config"].get("kv_lora_rank"):
            continue  # MLA: left to the published count
        total, active = estimate_params(entry["config"], model)
        assert abs(total - entry["params_total"]) / entry["params_total"] < 0.01, model
        if "params_active" in entry and not model.startswith("openai/gpt-oss"):  # counted without embeddings
            assert abs(active - entry["params_active"]) / entry["params_active"] < 0.02, model


@pytest.mark.slow
def test_weights_estimate_within_2_percent_of_real_files(default_model_dir):
    """The default GGUF (read from its tensor types) and a safetensors model (estimated from its
    config alone) against the bytes on disk."""
    from backends.default_model import default_model_path

    gguf = default_model_path()
    spec = resolve(str(gguf))
    assert spec.architecture == "llama" and spec.checkpoint_format == "Q4_1"
    assert abs(spec.weights_bytes - gguf.stat().st_size) / gguf.stat().st_size < 0.02
    config = json.loads((default_model_dir / "config.json").read_text())
    total, _ = estimate_params(config)
    on_disk = sum(f.stat().st_size for f in default_model_dir.glob("*.safetensors"))
    assert abs(total * 4 - on_disk) / on_disk < 0.02  # float32 on disk


@pytest.mark.slow
def test_a_measured_machine_is_read_at_the_models_row_width_and_not_derated_again():
    """`local` measures matrix-vector bandwidth with rows as wide as the model's hidden size, and a
    measured figure is what a kernel reached already: the decode estimate divides by it undiluted,
    where a datasheet figure gets the published 0.8."""
    from dataclasses import replace

    from backends.default_model import default_model_path

    gguf = str(default_model_path())
    assert resolve(gguf).hidden_size == 576 and resolve("Qwen/Qwen3-32B").hidden_size == 5120
    args = ["advise", "--model", gguf, "--hardware", "local", "--runtimes", "llama-cpp", "--format"]
    result = CliRunner().invoke(app, [*args, "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "576-wide rows" in report["hardware"]["source"] and report["hardware"]["measured"]
    assert report["assumptions"]["bandwidth"] == 1.0
    assert "bandwidth x1.0 (measured on this machine)" in CliRunner().invoke(app, [*args, "md"]).stdout
    datasheet = replace(hardware("cpu-x86"), bf16_tflops=1000.0)  # memory-bound decode
    measured = replace(datasheet, measured=True)
    load = Workload(prompt_tokens=64, output_tokens=32, concurrency=1)

    def decode(device) -> float:
        return advise(resolve(gguf), device, 1, load, runtimes=["llama-cpp"]).candidates[0].estimates[
            "decode_tokens_per_s_single"]

    assert decode(measured) / decode(datasheet) == pytest.approx(1 / 0.8)


def test_a_config_missing_a_field_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "num_attention_heads": 4, "vocab_size": 10}))
    with pytest.raises(MissingArchitectureField, match="'num_hidden_layers'"):
        resolve(str(tmp_path / "config.json"))
    result = CliRunner().invoke(app, ["advise", "--model", str(tmp_path), "--hardware", "l4"])
    assert result.exit_code == 2 and "num_hidden_layers" in result.output


def test_unknown_model_and_hardware_name_the_nearest_choices():
    with pytest.raises(UnknownModel, match="did you mean meta-llama/Llama-3.1-70B-Instruct"):
        resolve("meta-llama/Llama-3.1-70B")
    with pytest.raises(UnknownHardware, match="did you mean .*h100-sxm"):
        hardware("h100")
    result = CliRunner().invoke(app, ["advise", "--model", "Qwen/Qwen3-32B", "--hardware", "a100"])
    assert result.exit_code == 2 and "a100-80gb" in result.output


# -- rules ------------------------------------------------------------------------------------
def _rules(tmp_path, when: str, fields: dict | None = None, **extra):
    path = tmp_path / "rules.yaml"
    rule = {"id": "r", "kind": "warn", "when": when, "reason": "because", **extra}
    path.write_text(yaml.safe_dump({"fields": fields or {"a.n": "int", "a.s": "string", "a.x": "double"},
                                    "rules": [rule]}))
    return RuleSet.load(path)


@pytest.mark.parametrize(("when", "message"), [
    ("a.n > ", "Syntax error"),
    ("a.missing == 1", "unknown field 'a.missing'"),
    ("b.n == 1", "unknown field 'b.n'"),
    ("a.s > 1", "type error"),  # a string against a number
    ("a.x + 1 > 2.0", "type error"),  # CEL does not add double and int: 1.0 is meant
    ("a.s + 'x'", "must be a boolean"),
    ("1 > 2", "unreachable: its condition is always false"),
])
def test_invalid_rules_are_refused_at_load_naming_the_rule(tmp_path, when, message):
    with pytest.raises(RuleError, match=f"rule 'r'.*{message}"):
        _rules(tmp_path, when)


def test_a_rule_shadowed_by_an_earlier_exclusion_is_unreachable(tmp_path):
    path = tmp_path / "rules.yaml"
    rules = [{"id": "first", "kind": "exclude", "when": "a.n > 1", "reason": "r"},
             {"id": "second", "kind": "warn", "when": "a.n  >  1", "reason": "r"}]
    path.write_text(yaml.safe_dump({"fields": {"a.n": "int"}, "rules": rules}))
    with pytest.raises(RuleError, match="rule 'second' is unreachable: rule 'first' excludes first"):
        RuleSet.load(path)


def test_rules_file_shape_is_checked(tmp_path):
    with pytest.raises(RuleError, match="kind"):
        _rules(tmp_path, "a.n > 1", kind="maybe")
    with pytest.raises(RuleError, match="unknown field 'a.nope'"):
        _rules(tmp_path, "a.n > 1", reason="{a.nope}")
    ok = _rules(tmp_path, 'a.n > 1 && a.s.startsWith("h") && [1, 2].exists(v, v == a.n)', reason="n={a.n}")
    assert [f.reason for f in ok.evaluate({"a": {"n": 2, "s": "hi", "x": 0.0}})] == ["n=2"]
    assert ok.evaluate({"a": {"n": 3, "s": "hi", "x": 0.0}}) == []


SCENARIOS = [  # (model, hardware, gpus, workload): each shipped rule fires in at least one
    ("meta-llama/Llama-3.1-8B-Instruct", "m3-max", 1, Workload(concurrency=1, offline=True)),
    ("meta-llama/Llama-3.1-8B-Instruct", "l4", 1, Workload(kind="agent", prefix_reuse=0.6, concurrency=8,
                                                            kv_cache_dtype="q4_1")),
    ("deepseek-ai/DeepSeek-V3", "h100-sxm", 8, Workload(kv_cache_dtype="fp8")),
    ("deepseek-ai/DeepSeek-V3", "h200", 8, Workload(kv_cache_dtype="fp8", weight_quant="gguf",
                                                          expert_parallel=True)),
    ("meta-llama/Llama-3.1-70B-Instruct", "mi300x", 1, Workload(kv_cache_dtype="fp8_e5m2", prefix_reuse=0.4)),
    ("meta-llama/Llama-3.1-70B-Instruct", "a100-80gb", 4, Workload(new_deployment=False, existing_tgi=True)),
    ("meta-llama/Llama-3.2-1B-Instruct", "cpu-x86", 1, Workload(prompt_tokens=256, output_tokens=64,
                                                                 concurrency=2, offline=True)),
    ("Qwen/Qwen3-32B", "h100-sxm", 2, Workload(weight_quant="exl2")),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "a100-80gb", 2, Workload()),
    ("meta-llama/Llama-3.1-8B-Instruct", "rpi5", 1, Workload()),
    ("meta-llama/Llama-3.2-1B-Instruct", "t4", 1, Workload(new_deployment=False, existing_tgi=True)),
    ("meta-llama/Llama-3.1-8B-Instruct", "l4", 1, Workload(structured_output=True, multi_lora=True,
                                                            speculative_decoding=True)),
    ("meta-llama/Llama-3.1-8B-Instruct", "gaudi3", 1, Workload(weight_quant="nvfp4", prefix_reuse=0.5)),
    ("meta-llama/Llama-3.1-8B-Instruct", "tpu-v6e", 1, Workload(kv_cache_dtype="fp8_e4m3")),
]


@pytest.fixture(scope="module")
def scenario_reports():
    return [advise(resolve(m), hardware(h), g, w) for m, h, g, w in SCENARIOS]


def test_every_shipped_rule_fires_somewhere(scenario_reports):
    fired = {r["rule"] for report in scenario_reports for c in report.candidates for r in c.reasons}
    shipped = {rule.id for rule in RuleSet.load(RULES / "advisor.yaml").rules}
    assert shipped - fired == set()


def test_myths_are_contradicted_with_the_matrix_cell_source(scenario_reports):
    def notes(report, runtime):
        c = next(c for c in report.candidates if c.runtime == runtime)
        return {r["rule"]: r for r in c.reasons if r["kind"] == "note"}

    l4 = scenario_reports[1]
    vllm = notes(l4, "vllm")["myth-vllm-no-prefix-reuse"]
    assert vllm["cell"]["status"] == "yes" and "vllm/config/cache.py" in vllm["cell"]["line"]
    batch = notes(l4, "llama-cpp")["myth-llama-cpp-cannot-batch"]
    assert "common/arg.cpp" in batch["cell"]["line"] and batch["cell"]["path"] == "features.continuous_batching"
    trt = notes(l4, "tensorrt-llm")["myth-tensorrt-llm-engine-build"]
    assert trt["cell"]["status"] == "no" and "serve.py" in trt["cell"]["line"]
    tgi = notes(l4, "tgi")["myth-tgi-default"]
    assert "Maintenance mode" in tgi["cell"]["source"]
    assert next(c for c in l4.candidates if c.runtime == "tgi").verdict == "excluded"  # new deployment


def test_no_runtime_fits_says_so_with_reasons_and_the_nearest_fix(scenario_reports):
    report = scenario_reports[2]  # DeepSeek-V3 (671B, FP8) on 8 x H100 80 GB
    assert all(c.verdict == "excluded" for c in report.candidates)
    assert report.summary.startswith("no runtime fits") and "it fits from 16 x h100-sxm" in report.summary
    vllm = next(c for c in report.candidates if c.runtime == "vllm")
    assert [r["rule"] for r in vllm.reasons if r["kind"] == "exclude"] == ["does-not-fit"]
    h200 = scenario_reports[3]
    assert h200.candidates[0].verdict == "recommended"


def test_impossible_constraints_are_named():
    with pytest.raises(ImpossibleRequest, match="--prefix-reuse 1.5 must lie in"):
        advise(resolve("Qwen/Qwen3-32B"), hardware("h100-sxm"), 1, Workload(prefix_reuse=1.5))
    with pytest.raises(ImpossibleRequest, match="--kv-cache-dtype 'fp3'"):
        advise(resolve("Qwen/Qwen3-32B"), hardware("h100-sxm"), 1, Workload(kv_cache_dtype="fp3"))
    with pytest.raises(ImpossibleRequest, match="one machine"):
        advise(resolve("Qwen/Qwen3-32B"), hardware("m3-max"), 2, Workload())


def test_hardware_and_kv_restrictions_exclude_with_their_reasons(scenario_reports):
    mi300x = {c.runtime: c for c in scenario_reports[4].candidates}
    assert mi300x["tensorrt-llm"].verdict == "excluded"  # NVIDIA only
    assert not any(r["rule"] == "kv-dtype-unsupported" for r in mi300x["vllm"].reasons)  # e5m2 KV on ROCm too
    assert any(r["rule"] == "kv-dtype-unsupported" and "amd-cdna3" in r["reason"]
               for r in mi300x["tgi"].reasons)  # TGI refuses fp8_e5m2 on ROCm
    assert any(r["rule"] == "rocm-fp8-kv-e4m3" for r in mi300x["sglang"].reasons)


# -- the report -------------------------------------------------------------------------------
def test_json_report_has_the_documented_schema():
    result = CliRunner().invoke(app, ["advise", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--hardware",
                                      "h100-sxm", "--gpus", "4", "--prefix-reuse", "0.5", "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema_version"] == 1 and {"model", "hardware", "workload", "assumptions", "candidates",
                                            "summary"} <= set(data)
    candidates = data["candidates"]
    assert {c["runtime"] for c in candidates} == RUNTIMES
    verdicts = [c["verdict"] for c in candidates]
    assert verdicts[0] == "recommended" and verdicts == sorted(verdicts, key=["recommended", "viable",
                                                                              "excluded"].index)
    for c in candidates:
        assert {"runtime", "verdict", "reasons", "memory", "estimates"} <= set(c)
        bf16 = c["runtime"] != "builtin"  # the built-in engine keeps its KV cache in float32
        assert c["memory"]["kv_bytes_per_token"] == pytest.approx(327_680 if bf16 else 655_360)
    top = candidates[0]
    assert top["estimates"]["ttft_ms"] > 0 and top["launch"]["runtime_command"]
    assert top["launch"]["gateway_backend"]["kind"] == top["runtime"]


def test_markdown_report_shows_rules_and_commands():
    report = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("h100-sxm"), 1, Workload(prefix_reuse=0.5))
    text = to_markdown(report)
    assert "| rank | runtime | verdict |" in text and "`prefix-reuse-cached`" in text
    assert "servegate launch vllm --model meta-llama/Llama-3.1-8B-Instruct" in text
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct" in text and '"kind": "vllm"' in text
    assert json.loads(to_json(report))["summary"] == report.summary


def test_list_hardware():
    result = CliRunner().invoke(app, ["advise", "--list-hardware"])
    assert result.exit_code == 0 and "h100-sxm" in result.stdout and "mi300x" in result.stdout


@pytest.mark.slow
def test_html_report_renders_with_its_charts_in_headless_chromium(tmp_path, scenario_reports):
    import shutil
    import subprocess

    from PIL import Image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("CI runs this test: .ci/run installs Debian's chromium")
        pytest.skip("Chromium is not installed (.ci/run installs Debian's chromium)")
    page = tmp_path / "report.html"
    page.write_text(to_html(scenario_reports[1]))
    shot = tmp_path / "shot.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1400",
                    f"--screenshot={shot}", page.as_uri()], check=True, capture_output=True, timeout=120)
    image = Image.open(shot).convert("RGB")
    colours = {image.getpixel((x, y)) for x in range(0, image.width, 4) for y in range(0, image.height, 4)}
    assert (0x6E, 0x40, 0xC9) in colours  # the weights bars of the memory chart
    assert (0x1A, 0x7F, 0x37) in colours  # KV budget bars / the recommended candidate's goodput bar


@pytest.mark.slow
def test_measure_benchmarks_a_live_candidate_beside_its_estimate():
    """--measure against a real llama-cpp-python server on the default GGUF: the report carries the
    bench's figures next to the estimate, and how far off the estimate was."""
    from advisor.measure.baselines import free_port, llama_cpp_command, server_process
    from backends.default_model import default_model_path

    gguf = default_model_path()
    url = f"http://127.0.0.1:{free_port()}"
    args = ["advise", "--model", str(gguf), "--hardware", "cpu-x86", "--runtimes", "llama-cpp,builtin",
            "--prompt-tokens", "32", "--output-tokens", "16", "--concurrency", "1", "--num-prompts", "3",
            "--slo-ttft-ms", "10000", "--slo-tpot-ms", "1000", "--measure", f"llama-cpp={url}", "--format", "json"]
    with server_process(llama_cpp_command(gguf, int(url.rsplit(":", 1)[1])), url, "/v1/models"):
        result = CliRunner().invoke(app, args)
        learned = CliRunner().invoke(app, [*args, "--calibrate"])
    assert result.exit_code == 0, result.output
    assert learned.exit_code == 0, learned.output
    calibrated = json.loads(learned.stdout)
    assert calibrated["assumptions"]["calibration"].startswith("learned from llama.cpp (llama-server): TPOT")
    before = {c["runtime"]: c for c in json.loads(result.stdout)["candidates"]}["llama-cpp"]["estimates"]
    after = {c["runtime"]: c for c in calibrated["candidates"]}["llama-cpp"]
    assert after["measured"]["completed"] == 3  # the measurement stays beside the new estimate
    # the learned derates move the estimate toward the measurement
    assert abs(after["estimates"]["tpot_ms"] - after["measured"]["median_tpot_ms"]) <= \
        abs(before["tpot_ms"] - after["measured"]["median_tpot_ms"]) + 1e-6
    candidates = {c["runtime"]: c for c in json.loads(result.stdout)["candidates"]}
    measured = candidates["llama-cpp"]["measured"]
    assert measured["completed"] == 3 and measured["failed"] == 0 and measured["median_tpot_ms"] > 0
    estimate = candidates["llama-cpp"]["estimates"]["goodput_requests_per_s"]
    assert measured["off_by"] == pytest.approx((estimate - measured["request_goodput"]) / measured["request_goodput"])
    assert candidates["builtin"]["measured"] is None  # only what was measured


def test_measure_config_turns_servegate_yaml_backends_into_candidates(tmp_path):
    from advisor.cli import _config_entries

    config = tmp_path / "servegate.yaml"
    config.write_text(yaml.safe_dump({"backends": [
        {"name": "local", "kind": "builtin"},
        {"name": "a", "kind": "vllm", "url": "http://10.0.0.5:8000", "model": "meta-llama/Llama-3.1-8B-Instruct"},
        {"name": "b", "kind": "llama-server", "url": "http://10.0.0.6:8080", "model": "llama"}]}))
    assert _config_entries(config) == ["vllm=http://10.0.0.5:8000@meta-llama/Llama-3.1-8B-Instruct",
                                       "llama-cpp=http://10.0.0.6:8080@llama"]
    config.write_text(yaml.safe_dump({"backends": [{"name": "local", "kind": "builtin"}]}))
    result = CliRunner().invoke(app, ["advise", "--model", "Qwen/Qwen3-32B", "--hardware", "h100-sxm",
                                      "--measure-config", str(config)])
    assert result.exit_code == 2 and "no remote backend of a ranked runtime" in result.output


@pytest.mark.parametrize("args, says", [
    (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--prompt-tokens", "300000"],
     "exceed meta-llama/Llama-3.1-8B-Instruct's context of 131072 tokens"),
    (["--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpus", "3"], "64 attention heads evenly across the "
                                                                       "devices; use 2 or 4"),
    (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpus", "64"], "use 16 or 32"),
    (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--bandwidth-gbs", "-5"], "--bandwidth-gbs"),
    (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--tflops", "-1"], "--tflops"),
    (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--derate-bandwidth", "0"], "--derate-bandwidth 0: a share"),
    (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--derate-decode", "1.5"], "--derate-decode 1.5"),
])
def test_inputs_no_runtime_could_serve_exit_2_naming_the_problem(args, says):
    """Each of these was accepted (recommending a TP size vLLM refuses, a prompt past the model's
    context) or died in a ZeroDivisionError traceback."""
    hardware_args = ["--hardware", "h100-sxm"] if "--gpus" in args or "--prompt-tokens" in args else \
        ["--hardware", "l4"]
    result = CliRunner().invoke(app, ["advise", *hardware_args, *args])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and says in output, output
    assert "Traceback" not in output and not isinstance(result.exception, ZeroDivisionError)


@pytest.mark.slow
def test_a_request_rate_beyond_capacity_asks_for_replicas_instead_of_diverging():
    """`--request-rate 1000` iterated Little's law past capacity and reported ~2e25 requests queued
    with `meets_slo: true`."""
    load = Workload(request_rate=1000, prompt_tokens=512, output_tokens=128)
    report = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("l4"), 1, load)
    viable = [c for c in report.candidates if c.estimates]
    assert viable
    for c in viable:
        e = c.estimates
        assert e["replicas_needed"] == -(-1000 // e["capacity_requests_per_s"]) > 1
        assert e["queued"] is None and e["meets_slo"] is False and e["batch"] <= c.memory["max_sequences"]
    assert "replicas of this one" in to_markdown(report)
    modest = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("l4"), 1,
                    Workload(request_rate=0.05, prompt_tokens=512, output_tokens=128))
    assert all(c.estimates["replicas_needed"] == 1 and c.estimates["queued"] == 0
               for c in modest.candidates if c.estimates)


# -- mixture of experts, parallelism, ranking --------------------------------------------------
def _by_runtime(report):
    return {c.runtime: c for c in report.candidates}


def test_moe_decode_reads_the_union_of_routed_experts_as_by_hand():
    """DeepSeek-V3 (fp8) on 8 x H200 at batch 16, by hand:
    - experts a layer reads: 256 x (1 - (1 - 8/256)^16) = 101.97 (the report said 8);
    - an expert is 3 x 7168 x 2048 = 44,040,192 weights; 58 of 61 layers are MoE (3 dense);
    - every token also reads the 37e9 active weights less its 8 routed experts per layer:
      37e9 - 58 x 8 x 44,040,192 = 16.57e9;
    - a step reads 58 x 101.97 x 44,040,192 + 16.57e9 = 277.0e9 bytes at 1 byte a weight,
      over 8 x 4,800 GB/s x 0.8 = 30.72 TB/s: 9.02 ms;
    - its KV: 16 sequences x 1,152 tokens (1,024 + 256/2) x 61 layers x 576 (MLA) x 2 bytes, on
      each of the 8 devices: 10.36e9 bytes, 0.34 ms;
    - tensor parallelism: 2 all-reduces a layer of 16 x 7168 x 2 bytes, each 10 us + 2 x 7/8 of
      229,376 bytes over 450 GB/s: 61 x 2 x 10.89 us = 1.33 ms.
    TPOT 9.02 + 0.34 + 1.33 = 10.69 ms, where the report said 1.5 ms."""
    load = Workload(concurrency=16)
    vllm = _by_runtime(advise(resolve("deepseek-ai/DeepSeek-V3"), hardware("h200"), 8, load))["vllm"]
    e = vllm.estimates
    assert e["batch"] == 16
    assert e["experts_read_per_layer"] == pytest.approx(101.97, abs=0.01)
    assert e["decode_weight_gb_per_step"] == pytest.approx(277.0, rel=0.002)
    assert e["collectives_ms_per_step"] == pytest.approx(1.33, abs=0.005)
    assert e["tpot_ms"] == pytest.approx(10.69, rel=0.01)


@pytest.mark.parametrize("model, device, at_least_ms, was_ms", [
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mi300x", 21.0, 6.7),  # 16 tokens touch 7.9 of 8 experts
    ("openai/gpt-oss-120b", "h100-sxm", 9.0, 1.3),  # 51 of 128 experts a layer at batch 16
])
def test_moe_decode_at_batch_is_no_longer_optimistic(model, device, at_least_ms, was_ms):
    vllm = _by_runtime(advise(resolve(model), hardware(device), 1, Workload(concurrency=16)))
    tpot = next(c for c in vllm.values() if c.estimates).estimates["tpot_ms"]
    assert tpot >= at_least_ms > was_ms


def test_gpt_oss_weights_count_bf16_attention_beside_mxfp4_experts():
    """gpt-oss keeps attention, router, embeddings and head in bf16; its checkpoint is 60.8 GiB
    (OpenAI's model card), where MXFP4 for all 117e9 weights would say 57.9."""
    model = resolve("openai/gpt-oss-120b")
    assert model.weight_bytes("mxfp4") / 2**30 == pytest.approx(60.8, rel=0.03)
    assert model.experts.routed == 128 and model.experts.per_token == 4


def test_tensor_parallel_collectives_count_over_the_devices_link():
    """Llama-3.1-70B fp8 on 4 x L40S (PCIe 4.0, 32 GB/s a direction) at batch 16: 80 layers x 2
    all-reduces of 16 x 8192 x 2 bytes, each 10 us + 2 x 3/4 x 262,144 / 32e9 s = 22.29 us:
    3.57 ms a step, which the report left out. On NVLink A100s the same is 2.0 ms."""
    load = Workload(concurrency=16, weight_quant="fp8")
    model = resolve("meta-llama/Llama-3.1-70B-Instruct")
    l40s = _by_runtime(advise(model, hardware("l40s"), 4, load))["vllm"].estimates
    assert l40s["collectives_ms_per_step"] == pytest.approx(3.566, abs=0.005)
    a100 = _by_runtime(advise(model, hardware("a100-80gb"), 4, Workload(concurrency=16)))["vllm"].estimates
    assert a100["collectives_ms_per_step"] == pytest.approx(160 * (10e-6 + 1.5 * 262144 / 300e9) * 1000, rel=1e-3)


def test_expert_parallelism_is_a_choice_and_its_launch_lines_carry_the_flag():
    """SGLang's DeepSeek recipe runs TP only: expert parallelism is not required by default; asked
    for, the runtimes without it are excluded and the lines carry each runtime's flag."""
    model, h200 = resolve("deepseek-ai/DeepSeek-V3"), hardware("h200")
    plain = _by_runtime(advise(model, h200, 8, Workload()))
    assert plain["sglang"].verdict != "excluded"
    assert "expert" not in plain["vllm"].launch["runtime_command"]
    ep = _by_runtime(advise(model, h200, 8, Workload(expert_parallel=True)))
    assert "--enable-expert-parallel" in ep["vllm"].launch["runtime_command"]
    assert "--expert-parallel" in ep["vllm"].launch["servegate_command"]
    assert "--ep-size 8" in ep["sglang"].launch["runtime_command"]
    assert "--ep_size 8" in ep["tensorrt-llm"].launch["runtime_command"]
    assert ep["tgi"].verdict == "excluded" and any(r["rule"] == "expert-parallel-missing" for r in ep["tgi"].reasons)


def test_calibration_scales_the_term_that_bound_the_estimate():
    from advisor.advise import calibrated
    from advisor.capacity import Derates

    memory_bound = {"tpot_ms": 40.0, "ttft_ms": 1000.0, "decode_bound": "memory"}
    learned, how = calibrated(Derates(), memory_bound, {"median_tpot_ms": 80.0, "median_ttft_ms": 2000.0})
    assert learned.bandwidth == pytest.approx(0.4) and learned.prefill_compute == pytest.approx(0.225)
    assert learned.decode_compute == Derates().decode_compute and "bandwidth 0.8 -> 0.4" in how
    compute_bound = {**memory_bound, "decode_bound": "compute"}
    learned, how = calibrated(Derates(), compute_bound, {"median_tpot_ms": 10.0})
    assert learned.decode_compute == 1.0 and "capped at 1 from 1.20" in how


def test_corrected_cells():
    """Each of these was wrong against the runtime's own code or docs."""
    m = matrices()
    assert m["vllm"].memory.default_fraction == 1.0  # 0.34.0: the extensible KV cache on CUDA and ROCm
    assert m["vllm"].weight_quant["fp8"].on("nvidia-turing") == "yes"  # W8A16 through FP8 Marlin
    assert m["lmdeploy"].weight_quant["fp8"].on("nvidia-volta") == "yes"  # TurboMind's FP8 kernels from sm70
    assert m["tensorrt-llm"].weight_quant["mxfp4"].on("nvidia-hopper") == "yes"  # gpt-oss on H200, TRITON MoE
    gpt_oss = _by_runtime(advise(resolve("openai/gpt-oss-120b"), hardware("h200"), 1, Workload()))
    assert gpt_oss["tensorrt-llm"].verdict != "excluded"
    assert m["tensorrt-llm"].moe["expert_parallel"].flag == "--ep_size"


def test_stale_and_unsupported_cells_were_reread():
    """Each read differently at its source than the matrix said (sources and dates in the cells)."""
    m = matrices()
    assert m["sglang"].hardware["amd-cdna4"].status == "yes"  # rocm700-mi35x release images
    assert m["sglang"].weight_quant["gguf"].on("amd-cdna3") == "no"  # not in ROCm's allow-list
    assert m["sglang"].hardware["nvidia-volta"].status == "no"  # "only supports sm75 and above"
    assert m["llama-cpp"].weight_quant["mxfp4"].status == "yes" and m["llama-cpp"].architectures["llama4"].status \
        == "yes"  # GGML_TYPE_MXFP4, LLM_ARCH_LLAMA4
    assert m["vllm"].hardware["aws-neuron"].status == "partial" and "vllm-neuron" in m["vllm"].hardware[
        "aws-neuron"].note
    assert m["lmdeploy"].features["continuous_batching"].status == "yes"
    assert m["lmdeploy"].kv_cache["int8"].on("huawei-ascend") == "yes"
    assert m["lmdeploy"].kv_cache["int4"].on("huawei-ascend") != "yes"
    assert m["tgi"].features["pipeline_parallel"].status == "no" and m["tgi"].architectures["gpt_oss"].status == "no"


@pytest.mark.parametrize("memory_gib, tp, expected", [
    (80, 1, 0.830),  # H100: chunk 8192, graphs 256, 58 prefill graphs: 512 + 12288 + 128 + 512 + 464 of 81,920
    (141, 8, 0.894),  # H200 at TP 8: graphs 512, group 1,024, 58 prefill graphs: 15,312 MiB of 144,384
    (24, 1, 0.704),  # L4: chunk 4096, graphs 48, 50 prefill graphs: 512 + 6144 + 128 + 96 + 400 of 24,576
])
def test_sglang_memory_fraction_follows_its_server_args_heuristic(memory_gib, tp, expected):
    memory = matrices()["sglang"].memory
    assert memory.status == "yes" and memory.fraction_for(memory_gib, tp) == expected


def test_ties_are_reported_as_ties_not_broken_by_name():
    """SGLang was "recommended" over vLLM at equal estimates because "sglang" < "vllm"."""
    report = advise(resolve("meta-llama/Llama-3.1-70B-Instruct"), hardware("l40s"), 4,
                    Workload(concurrency=16, weight_quant="fp8"))
    top = [c.runtime for c in report.candidates if c.verdict == "recommended"]
    assert {"vllm", "sglang"} <= set(top)
    assert any(("tie" in note or "indistinguishable" in note) and "--measure" in note for note in report.notes)
    assert " and " in report.summary and "are recommended" in report.summary


def test_a_lead_resting_on_unverified_cells_is_no_lead():
    from advisor.advise import Candidate, _rank

    def candidate(runtime, goodput, fraction_status, unverified_bonus=0.0):
        c = Candidate(runtime, runtime.upper(), "1")
        c.estimates = {"goodput_requests_per_s": goodput}
        c.memory = {"features": 0, "fraction_status": fraction_status, "fraction": 0.9}
        if unverified_bonus:
            c.score += unverified_bonus
            c.reasons.append({"rule": "r", "kind": "score", "score": unverified_bonus, "reason": "",
                              "cell": {"status": "unverified", "path": "features.x"}})
        return c

    by_fraction = [candidate("a", 10.0, "yes"), candidate("b", 7.0, "unverified")]
    notes = _rank(by_fraction)
    assert [c.verdict for c in by_fraction] == ["recommended", "recommended"]
    assert "only through unverified cells" in notes[0] and "B's memory fraction" in notes[0]
    by_rule = [candidate("a", 5.0, "yes", unverified_bonus=1.0), candidate("b", 5.0, "yes")]
    assert "A features.x" in _rank(by_rule)[0]
    verified = [candidate("a", 10.0, "yes"), candidate("b", 7.0, "yes")]
    assert _rank(verified) == [] and [c.verdict for c in verified] == ["recommended", "viable"]


@pytest.mark.slow
def test_no_runtime_meeting_the_slo_is_said_plainly_with_estimated_alternatives():
    """Every goodput was 0 and one runtime was still "recommended", with no advice."""
    report = advise(resolve("meta-llama/Llama-3.1-70B-Instruct"), hardware("l4"), 8, Workload(slo_tpot_ms=20))
    assert not any(c.verdict == "recommended" for c in report.candidates)
    assert report.summary.startswith("No runtime meets this SLO (TTFT <= 2000 ms, TPOT <= 20 ms)")
    changes = {a["change"].split()[0]: a for a in report.alternatives}
    assert {"--weight-quant", "--gpus", "--slo-ttft-ms"} <= set(changes)
    looser = changes["--slo-ttft-ms"]
    assert looser["meets_slo"] and looser["goodput_requests_per_s"] > 0 and looser["tpot_ms"] > 20
    assert all(a["tpot_ms"] is not None for a in report.alternatives)
    assert "What would meet the SLO" in to_markdown(report)


@pytest.mark.slow
def test_requirement_flags_read_the_feature_cells():
    load = Workload(structured_output=True, multi_lora=True, speculative_decoding=True)
    report = _by_runtime(advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("l4"), 1, load))
    assert any(r["rule"] == "multi-lora-missing" for r in report["ollama"].reasons)  # one ADAPTER per Modelfile
    assert report["ollama"].verdict == "excluded"
    limited = [r for r in report["lmdeploy"].reasons if r["rule"] == "multi-lora-limited"]  # PyTorch engine
    assert limited and limited[0]["cell"]["path"] == "features.multi_lora"
    assert report["vllm"].verdict != "excluded"
    result = CliRunner().invoke(app, ["advise", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--hardware", "l4",
                                      "--multi-lora", "--format", "json"])
    assert result.exit_code == 0 and '"multi_lora": true' in result.output


def test_the_catalogue_reaches_every_accelerator_column_with_sourced_links():
    devices = {d.id: d for d in catalogue_devices().values()}
    for new in ("ascend-910b", "tpu-v6e", "mi325x", "mi355x", "h20", "b200", "gb200", "gaudi3"):
        assert new in devices, new
    families = {d.family for d in devices.values()}
    assert {"huawei-ascend", "google-tpu", "amd-cdna4"} <= families
    for d in devices.values():
        if d.gpu:
            assert d.link_gbs and d.link_source, d.id
    ascend = _by_runtime(advise(resolve("Qwen/Qwen3-32B"), hardware("ascend-910b"), 2, Workload()))
    assert any(c.verdict != "excluded" for c in ascend.values())
    assert "unverified" in devices["ascend-910b"].note


def test_a_model_too_big_for_one_card_is_told_both_fixes():
    """A T4 was told "fits from 2 x t4" without the 8-bit weights that fit on one."""
    report = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("t4"), 1, Workload())
    assert "it fits from 2 x t4" in report.summary and "--weight-quant fp8" in report.summary


@pytest.mark.slow
def test_a_prompt_past_the_native_context_names_yarn_and_its_limit():
    """A 128k prompt on Qwen3-32B (native 32k, 40,960 in its config) gave no YaRN note."""
    report = advise(resolve("Qwen/Qwen3-32B"), hardware("h200"), 1, Workload(prompt_tokens=128000,
                                                                              output_tokens=1000))
    assert any("yarn RoPE scaling, factor 4" in note and "Qwen3-32B model card" in note for note in report.notes)
    with pytest.raises(ImpossibleRequest, match="context of 131072 tokens \\(with yarn"):
        advise(resolve("Qwen/Qwen3-32B"), hardware("h200"), 1, Workload(prompt_tokens=140000))
    short = advise(resolve("Qwen/Qwen3-32B"), hardware("h200"), 1, Workload())
    assert not any("RoPE" in note for note in short.notes)


@pytest.mark.slow
def test_the_examples_document_is_what_the_advisor_says_today():
    """docs/advisor-examples.md is generated (`python -m advisor.examples`): a change to a cell, a
    rule or the model that moves an answer must regenerate it."""
    from pathlib import Path

    from advisor.examples import SCENARIOS, WHY, render

    assert len(SCENARIOS) >= 9 and set(WHY) == {s[0] for s in SCENARIOS}
    assert (Path(__file__).resolve().parents[1] / "docs" / "advisor-examples.md").read_text() == render()


LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("args, says", [
    (["--request-rate", "nan"], "--request-rate nan"),
    (["--request-rate", "inf"], "--request-rate inf"),
    (["--request-rate", "-2"], "--request-rate must be positive"),
    (["--request-rate", "0"], "--request-rate must be positive"),
    (["--slo-ttft-ms", "nan"], "--slo-ttft-ms nan"),
    (["--slo-tpot-ms", "inf"], "--slo-tpot-ms inf"),
    (["--slo-ttft-ms", "0"], "SLOs must be positive"),
    (["--slo-tpot-ms", "-5"], "SLOs must be positive"),
    (["--prefix-reuse", "nan"], "--prefix-reuse nan"),
    (["--prefix-reuse", "1"], "--prefix-reuse 1.0 must lie in [0, 1)"),
    (["--prefix-reuse", "-0.1"], "--prefix-reuse -0.1 must lie in [0, 1)"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
    (["--output-tokens", "0"], "--output-tokens must be at least 1"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--tflops", "nan"], "--tflops"),
    (["--tflops", "inf"], "--tflops"),
    (["--bandwidth-gbs", "nan"], "--bandwidth-gbs"),
    (["--bandwidth-gbs", "inf"], "--bandwidth-gbs"),
    (["--bandwidth-gbs", "0"], "--bandwidth-gbs"),
    (["--derate-prefill", "nan"], "--derate-prefill nan"),
    (["--derate-bandwidth", "2"], "--derate-bandwidth 2"),
    (["--derate-decode", "-1"], "--derate-decode -1"),
    (["--acceptance", "0.5"], "--acceptance needs --draft-tokens"),
    (["--draft-tokens", "3", "--acceptance", "1"], "--acceptance 1.0 must lie in [0, 1)"),
    (["--draft-tokens", "3", "--acceptance", "nan"], "--acceptance nan"),
    (["--draft-tokens", "-1"], "--draft-tokens must lie in [0, 16]"),
    (["--kv-cache-dtype", "fp7"], "--kv-cache-dtype 'fp7'"),
    (["--weight-quant", "int3"], "--weight-quant: unknown weight format 'int3'"),
    (["--workload", "poetry"], "--workload 'poetry'"),
    (["--format", "pdf"], "md, html or json"),
    (["--trace", "/nonexistent/trace.jsonl"], "no such file"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct", "--hardware", "h100-sxm", "--gpus", "7"], "4 KV heads"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct", "--hardware", "h100-sxm", "--gpus", "3"], "28 attention heads"),
    (["--model", "Qwen/Qwen2.5-7B-Instruct", "--hardware", "h100-sxm", "--gpus", "14"], "neither a divisor nor"),
    (["--model", "mistralai/Mixtral-8x7B-Instruct-v0.1", "--hardware", "h100-sxm", "--gpus", "16",
      "--expert-parallel"], "8 routed experts"),
    (["--expert-parallel"], "is dense, it has no experts to split"),
    (["--model", "no/such-model"], "no/such-model"),
    (["--hardware", "h1000"], "unknown hardware 'h1000'"),
    (["--runtimes", "vllm,warp9"], "warp9"),
    (["--gpus", "0"], "--gpus"),
    (["--lora-rank", "0"], "--lora-rank 0 must lie in [1, 512]"),
    (["--lora-rank", "1024"], "--lora-rank 1024 must lie in [1, 512]"),
    (["--lora-adapters", "-1"], "--lora-adapters must be at least 0"),
    (["--lora", "no-path"], "--lora: LoRA adapter 'no-path': NAME=PATH"),
    (["--lora", "a=./x", "--lora", "a=./y"], "LoRA adapter 'a' is given twice"),
    (["--max-context", "100"], "--max-context 100 is below --prompt-tokens + --output-tokens (1280)"),
    (["--max-context", "1000000"], "--max-context 1000000 exceeds meta-llama/Llama-3.1-8B-Instruct's context"),
])
def test_bad_inputs_exit_2_naming_the_input_never_a_traceback(args, says):
    """Each of these passed silently (NaN SLOs printed back as alternatives, an infinite bandwidth's
    0.87 ms TPOT, --expert-parallel on a dense model ignored, 7 GPUs for 4 KV heads recommended)
    or died in a traceback."""
    base = {"--model": LLAMA, "--hardware": "l4"}
    given = dict(zip(args[::2], args[1::2], strict=False))
    command = ["advise", *[x for k, v in base.items() if k not in given for x in (k, v)], *args]
    result = CliRunner().invoke(app, command)
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and says in output, output
    assert "Traceback" not in output and not isinstance(result.exception, (ValueError, TypeError))


@pytest.mark.slow
def test_every_format_carries_the_same_content():
    """Ranking with ranges, exclusions with their cited cells and code lines, ties, what would meet
    the SLO, launch lines and assumptions: in Markdown, in HTML (with the goodput curve) and in JSON."""
    import html as html_lib

    from advisor.report import RANKING, _assumptions, _details

    tie = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("l40s"), 1,
                 Workload(concurrency=16, lora_paths=["a=./lora/a", "b=./lora/b"]))
    short = advise(resolve("meta-llama/Llama-3.1-8B-Instruct"), hardware("l4"), 1, Workload(concurrency=32))
    for report in (tie, short):
        md, page, data = to_markdown(report), html_lib.unescape(to_html(report)), json.loads(to_json(report))
        items = [report.summary, *report.notes, *RANKING, *_assumptions(report),
                 *(a["change"] for a in report.alternatives),
                 *(line for c in report.candidates for line in _details(report, c))]
        for item in items:
            plain = item.replace("`", "").replace("_(", "(").replace(")_", ")")
            assert item in md, item
            assert plain in page.replace("<code>", "").replace("</code>", "").replace("<small>", "").replace(
                "</small>", ""), plain
        assert data["summary"] == report.summary and data["notes"] == report.notes
        assert data["alternatives"] == json.loads(json.dumps(report.alternatives, default=str))
        assert "Goodput within the SLO against the offered rate" in page
    assert tie.notes and "measure both" in tie.notes[0]
    assert short.alternatives and any("code:" in line for c in short.candidates for line in _details(short, c))
