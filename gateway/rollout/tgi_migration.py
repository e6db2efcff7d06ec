"""`servegate migrate tgi`: read a TGI deployment (its launcher flags and environment) and write
the plan that moves its traffic to vLLM or SGLang behind one alias, with TGI's clients unchanged:
equivalent launch commands (every flag without an equivalent named, traps called out), the
gateway backends and route versions, the shadow -> canary -> promote steps with the rollout
thresholds, and the rollback command.

TGI's launcher takes each flag as `--kebab-case` or as the environment variable in
SCREAMING_CASE (`--max-total-tokens` / `MAX_TOTAL_TOKENS`; docs/source/reference/launcher.md)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

import yaml

from backends.launch import LaunchSpec, shell_line
from policies.rollout import RolloutPolicy

# TGI flag -> (vLLM, SGLang) equivalents, each a flag or None, and what to know. Flags the plan
# maps through the normalized launch spec (model, shards, context, KV dtype, batch size, prefix
# caching) are not listed here.
EXTRA: dict[str, tuple[str | None, str | None, str]] = {
    "revision": ("--revision", "--revision", ""),
    "dtype": ("--dtype", "--dtype", ""),
    "trust-remote-code": ("--trust-remote-code", "--trust-remote-code", ""),
    "max-batch-prefill-tokens": ("--max-num-batched-tokens", "--chunked-prefill-size",
                                 "the tokens prefilled per step: vLLM's chunked-prefill budget, SGLang's chunk size"),
    "max-concurrent-requests": (None, None, "TGI's router refuses requests beyond it; the gateway does this now "
                                            "(SERVEGATE_MAX_IN_FLIGHT + SERVEGATE_MAX_QUEUED, 503 with Retry-After)"),
    "max-batch-total-tokens": (None, None, "TGI's KV budget in tokens; vLLM and SGLang size the KV cache from "
                                           "--gpu-memory-utilization / --mem-fraction-static instead"),
    "cuda-memory-fraction": ("--gpu-memory-utilization", "--mem-fraction-static",
                             "not the same share: TGI's caps the process, vLLM's and SGLang's are the share of "
                             "total memory for weights + KV cache; start from 0.9"),
    "max-best-of": (None, None, "best_of is not offered by vLLM's or SGLang's OpenAI servers; clients asking for it "
                                "get an error"),
    "max-stop-sequences": (None, None, "no such limit in vLLM or SGLang; the gateway's TGI API keeps TGI's"),
    "max-input-tokens": (None, None, "implied by the context (--max-model-len / --context-length) minus the output"),
    "max-input-length": (None, None, "legacy name of --max-input-tokens"),
    "max-waiting-tokens": (None, None, "TGI scheduler tuning with no counterpart"),
    "waiting-served-ratio": (None, None, "TGI scheduler tuning with no counterpart"),
    "speculate": (None, None, "TGI's Medusa/n-gram speculation: use vLLM --speculative-config or SGLang "
                              "--speculative-algorithm with a draft or n-gram method"),
    "cuda-graphs": (None, "--cuda-graph-bs", "vLLM captures CUDA graphs by default (--enforce-eager turns them "
                                              "off)"),
    "rope-scaling": (None, None, "pass through --hf-overrides (vLLM) / --json-model-override-args (SGLang)"),
    "rope-factor": (None, None, "pass through --hf-overrides (vLLM) / --json-model-override-args (SGLang)"),
    "api-key": ("--api-key", "--api-key", "or let the gateway hold the keys (per tenant)"),
    "disable-grammar-support": (None, "--grammar-backend none", ""),
}
# TGI --quantize -> each runtime's --quantization (None: no equivalent).
QUANTIZE = {"awq": ("awq", "awq"), "gptq": ("gptq", "gptq"), "marlin": ("gptq_marlin", "marlin"),
            "fp8": ("fp8", "fp8"), "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
            "bitsandbytes-nf4": ("bitsandbytes", "bitsandbytes"), "bitsandbytes-fp4": ("bitsandbytes", "bitsandbytes"),
            "compressed-tensors": ("compressed-tensors", "compressed-tensors"), "eetq": (None, None),
            "exl2": (None, None)}
KV = {"fp8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
LORA_ENTRY = re.compile(r"^([^=@]+)(?:=([^@]+))?(?:@(.+))?$")  # TGI's own pattern
IGNORED = {"hostname", "port", "prometheus-port", "json-output", "otlp-endpoint", "otlp-service-name",
           "cors-allow-origin", "sharded", "validation-workers", "max-client-batch-size", "usage-stats",
           "payload-limit", "graceful-termination-timeout", "huggingface-hub-cache", "weights-cache-override",
           "disable-custom-kernels", "tokenizer-config-path", "watermark-gamma", "watermark-delta",
           "enable-prefill-logprobs", "max-top-n-tokens"}
TRAPS = {
    "sglang": "SGLang's --max-total-tokens is the size of its KV pool, not TGI's per-request context: the context "
              "goes to --context-length.",
    "vllm": "vLLM's --max-model-len is the per-request context (TGI's --max-total-tokens); its KV cache is sized by "
            "--gpu-memory-utilization, not by a token count.",
}


class MigrationError(ValueError):
    """The TGI arguments cannot be read; the message says which."""


def lora_adapters(value: str) -> dict[str, str]:
    """TGI's `--lora-adapters` / `LORA_ADAPTERS`, as adapter name -> path: comma-separated entries,
    each `id` or `id=path`, optionally with `@revision` (TGI's `parse_lora_adapters` in
    server/text_generation_server/utils/adapter.py). An adapter without a path is read from the
    Hub by its id, which is its path for vLLM and SGLang too; a revision has no equivalent there."""
    adapters = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        match = LORA_ENTRY.match(entry)
        if match is None or entry.count("=") > 1 or entry.count("@") > 1:
            raise MigrationError(f"--lora-adapters {entry!r}: TGI takes `id` or `id=path`, each optionally `@revision`")
        name, path, revision = match.groups()
        if revision is not None:
            raise MigrationError(f"--lora-adapters {entry!r}: vLLM and SGLang take no adapter revision; give the "
                                 "revision's downloaded directory as `id=path`")
        adapters[name] = path or name
    return adapters


@dataclass
class TGIDeployment:
    flags: dict[str, str] = field(default_factory=dict)  # kebab-case name -> value ("true" for switches)

    @classmethod
    def parse(cls, args: list[str]) -> TGIDeployment:
        """Launcher flags (`--flag value`, `--flag=value`, switches) and `NAME=value` environment."""
        flags: dict[str, str] = {}
        i = 0
        while i < len(args):
            arg = args[i]
            if arg.startswith("--"):
                name, _, value = arg[2:].partition("=")
                if not value and i + 1 < len(args) and not args[i + 1].startswith("--") and "=" not in args[i + 1]:
                    value, i = args[i + 1], i + 1
                flags[name] = value or "true"
            elif "=" in arg and arg.split("=", 1)[0].isupper():
                name, value = arg.split("=", 1)
                flags[name.lower().replace("_", "-")] = value
            else:
                raise MigrationError(f"cannot read {arg!r}: pass TGI's launcher flags (--model-id ...) or its "
                                     "environment (MODEL_ID=...)")
            i += 1
        if "model-id" not in flags:
            raise MigrationError("the TGI deployment needs --model-id (or MODEL_ID=...)")
        return cls(flags)

    def int(self, name: str) -> int | None:
        value = self.flags.get(name)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise MigrationError(f"--{name} {value!r} is not a number") from None

    @property
    def prefix_caching(self) -> bool | None:
        value = self.flags.get("prefix-caching", self.flags.get("use-prefix-caching"))
        return None if value is None else value.lower() not in ("0", "false", "no")


def plan(tgi: TGIDeployment, alias: str, tgi_url: str, candidate_url: str, candidate: str = "vllm",
         rollout: RolloutPolicy | None = None) -> dict:
    """The migration plan as data (the Markdown form renders it)."""
    rollout = rollout or RolloutPolicy()
    model = tgi.flags["model-id"]
    shards = tgi.int("num-shard") or 1
    context = tgi.int("max-total-tokens")
    kv = tgi.flags.get("kv-cache-dtype")
    adapters = lora_adapters(tgi.flags.get("lora-adapters", ""))
    if kv is not None and kv not in KV:
        raise MigrationError(f"--kv-cache-dtype {kv!r}: TGI takes fp8_e4m3fn or fp8_e5m2")
    commands, unmapped = {}, []
    for runtime in ("vllm", "sglang"):
        side = 0 if runtime == "vllm" else 1
        extra: list[str] = []
        for name, value in tgi.flags.items():
            if name in EXTRA and EXTRA[name][side]:
                flag = EXTRA[name][side]
                extra += flag.split() if value == "true" else [*flag.split(), value]
        if (q := tgi.flags.get("quantize")) is not None:
            if q not in QUANTIZE:
                raise MigrationError(f"--quantize {q!r} is not one of TGI's ({', '.join(QUANTIZE)})")
            if QUANTIZE[q][side]:
                extra += ["--quantization", QUANTIZE[q][side]]
        spec = LaunchSpec(runtime=runtime, model=model, port=8001 if runtime == candidate else 8002,
                          context_length=context, tensor_parallel=shards, kv_cache_dtype=KV.get(kv or ""),
                          max_running_requests=tgi.int("max-batch-size"), prefix_caching=tgi.prefix_caching,
                          lora_modules=adapters, extra_args=extra)
        commands[runtime] = shell_line(spec, portable=True)
    for name, value in tgi.flags.items():
        if name in EXTRA:
            vllm_flag, sglang_flag, note = EXTRA[name]
            if not (vllm_flag and sglang_flag) or note:
                unmapped.append({"flag": f"--{name}", "value": value, "vllm": vllm_flag, "sglang": sglang_flag,
                                 "note": note})
        elif name == "quantize" and QUANTIZE.get(value) == (None, None):
            unmapped.append({"flag": "--quantize", "value": value, "vllm": None, "sglang": None,
                             "note": f"{value} has no vLLM/SGLang loader: requantize (AWQ, GPTQ or FP8)"})
        elif name == "speculate" or name in IGNORED or name in (
                "model-id", "num-shard", "max-total-tokens", "kv-cache-dtype", "max-batch-size", "prefix-caching",
                "use-prefix-caching", "quantize", "lora-adapters"):
            continue
        else:
            unmapped.append({"flag": f"--{name}", "value": value, "vllm": None, "sglang": None,
                             "note": "not known to this plan: check it by hand"})
    # Each backend is also served under its own name; clients use the alias.
    backends = [{"name": "tgi", "kind": "tgi", "url": tgi_url, "model": model, "served_name": f"{alias}-tgi"},
                {"name": candidate, "kind": candidate, "url": candidate_url, "model": model,
                 "served_name": f"{alias}-{candidate}"}]
    routes = {
        "1-shadow": {"targets": [{"backend": "tgi"}], "shadow": {"backend": candidate, "share": 0.1}},
        "2-canary": {"targets": [{"backend": candidate}], "fallbacks": ["tgi"]},
    }
    guard = rollout.model_dump()
    steps = [
        {"step": "start the candidate", "command": commands[candidate]},
        {"step": "put both behind the gateway (servegate.yaml)", "command": "servegate serve --config servegate.yaml"},
        *({"step": f"register TGI's adapter {name} on the alias (name the tenants that may use it with --tenants)",
           "command": f"servegate adapters add {shlex.quote(name)} --base {shlex.quote(alias)} "
                      f"--path {shlex.quote(path)}"} for name, path in adapters.items()),
        {"step": "shadow: TGI keeps answering; 10% of requests are mirrored to the candidate",
         "command": f"servegate routes deploy {alias} -f route-1-shadow.yaml"},
        {"step": "read the comparison (errors, latency, exact match on greedy requests)",
         "command": f"servegate routes shadow-report {alias}"},
        {"step": f"canary: 10% of live traffic to the candidate, guarded by policies/rollout.yaml (rolled back on "
                 f"its own beyond +{guard['max_error_rate_delta']:.0%} errors or {guard['max_ttft_p95_ratio']:g}x "
                 f"TTFT p95 / {guard['max_tpot_p95_ratio']:g}x TPOT p95 over {guard['window_s']:g} s and "
                 f"{guard['min_requests']} requests)",
         "command": f"servegate routes deploy {alias} -f route-2-canary.yaml --canary 10%"},
        {"step": "promote once the canary holds", "command": f"servegate routes promote {alias}"},
    ]
    return {
        "alias": alias, "model": model, "candidate": candidate, "tgi": tgi.flags, "commands": commands,
        "adapters": [{"name": name, "base": alias, "path": path} for name, path in adapters.items()],
        "unmapped": unmapped, "traps": [TRAPS["vllm"], TRAPS["sglang"]], "servegate_yaml": {"backends": backends},
        "routes": routes, "rollout": guard, "steps": steps,
        "rollback": f"servegate routes rollback {alias}  # ends the canary, or returns to the TGI version",
        "clients": f"TGI clients keep calling POST /generate and /generate_stream, now on the gateway: give their "
                   f"tenants the alias alone (`servegate tenants update TENANT --models {alias}`) and those routes "
                   f"need no model, or call /tgi/{alias}/generate; `parameters.adapter_id` still picks an adapter. "
                   f"OpenAI clients use model {alias!r}, or an adapter's id as the model.",
    }


def to_markdown(p: dict) -> str:
    lines = [f"# Migrating `{p['model']}` off TGI to {p['candidate']}", "", p["clients"], "",
             "## Equivalent commands", ""]
    for runtime, text in p["commands"].items():
        lines += [f"{runtime}:", "", f"    {text}", ""]
    lines += ["## Traps", "", *(f"- {t}" for t in p["traps"]), "", "## Flags that do not carry over one to one", ""]
    lines += [f"- `{u['flag']} {u['value']}`: vLLM {u['vllm'] or 'none'}, SGLang {u['sglang'] or 'none'}"
              + (f"; {u['note']}" if u["note"] else "") for u in p["unmapped"]] or ["- none"]
    lines += ["", "## servegate.yaml", "", *("    " + line for line in yaml.safe_dump(
        p["servegate_yaml"], sort_keys=False).splitlines()), ""]
    for name, route in p["routes"].items():
        lines += [f"## route-{name}.yaml", "", *("    " + line for line in yaml.safe_dump(
            route, sort_keys=False).splitlines()), ""]
    lines += ["## Steps", ""]
    lines += [f"{i}. {s['step']}:\n\n       {s['command']}\n" for i, s in enumerate(p["steps"], 1)]
    lines += ["## Rollback", "", f"    {p['rollback']}", ""]
    return "\n".join(lines)
