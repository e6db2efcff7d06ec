"""Speculative decoding by prompt lookup: the proposer, the acceptance rule, and the engine's output
unchanged by speculation (greedy and seeded sampling, single and batched, beside prefix caching,
chunked prefill, preemption, stops, logprobs, penalties and n > 1), with no block leaked.

A random tiny model never repeats its prompt, so the tiny model's tests draft from an oracle: the
output the engine gives without speculation, with a wrong token at a random place in most drafts,
which exercises every acceptance length. The default model copies for real (slow tier)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.builtin.config import EngineConfig
from backends.builtin.core.ngram import NgramProposer
from backends.builtin.core.sampler import accept, sample
from backends.builtin.core.sequence import SamplingParams, Sequence
from backends.constraints import Constraint

GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
VOCAB = 49152


class Oracle:
    """Drafts the known continuation of a sequence (prompt + reference output), most with a wrong
    token at a random place."""

    def __init__(self, continuations: list[list[int]], seed: int = 0) -> None:
        self.continuations = continuations
        self.random = random.Random(seed)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for full in self.continuations:
            if full[: len(token_ids)] == token_ids:
                drafts = full[len(token_ids) : len(token_ids) + k]
                wrong = self.random.randint(0, len(drafts))
                if wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % VOCAB
                return drafts
        return []


def outputs(engine, prompts, params, stop=()) -> list[dict]:
    """Each request's choices: tokens, text, logprobs and finish reason, stepped to completion."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    got: list[dict] = [{} for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{engine.steps}-{i}", prompt, p, stop)
    while engine.has_work:
        for out in engine.step():
            choice = got[int(out.request_id.rpartition("-")[2])].setdefault(
                out.index, {"tokens": [], "text": "", "logprobs": [], "reason": None})
            choice["tokens"] += out.token_ids
            choice["text"] += out.text
            choice["logprobs"] += out.logprobs
            choice["reason"] = out.finish_reason
    return got


def speculating(make_engine, model, reference: list[dict], prompts, k: int = 4, **config):
    """An engine that speculates `k` tokens from the oracle of `reference` (outputs of `prompts`)."""
    engine = make_engine(model, dtype="float64", num_speculative_tokens=k, **config)
    engine.scheduler.proposer = Oracle([p + c["tokens"] for p, out in zip(prompts, reference)
                                        for c in out.values()])
    return engine


def tokens(got: list[dict]) -> list[dict[int, list[int]]]:
    return [{i: c["tokens"] for i, c in out.items()} for out in got]


# -- the proposer -----------------------------------------------------------------------------
def test_the_longest_recurring_ngram_proposes_what_followed_its_earliest_occurrence():
    proposer = NgramProposer(min_n=2, max_n=4)
    token_ids = [4, 2, 3, 7, 1, 2, 3, 9, 1, 2, 3]
    assert proposer.propose(token_ids, 2) == [9, 1]  # "1 2 3" recurs: longer than "2 3", which came first
    assert NgramProposer(min_n=2, max_n=2).propose(token_ids, 2) == [7, 1]
    assert proposer.propose([5, 1, 2, 3, 9, 6, 1, 2, 3, 8, 1, 2, 3], 1) == [9]  # the earliest of equals
    assert proposer.propose([7, 1, 2, 3, 4, 1, 2, 3], 5) == [4, 1, 2, 3]  # up to the end, no further


def test_the_proposer_needs_min_n_tokens_to_recur_and_stops_at_max_n():
    token_ids = [5, 1, 2, 9, 6, 1, 2]
    assert NgramProposer(min_n=2, max_n=5).propose(token_ids, 2) == [9, 6]
    assert NgramProposer(min_n=3, max_n=5).propose(token_ids, 2) == []  # only "1 2" recurs
    assert NgramProposer(min_n=1, max_n=5).propose([4, 5, 6], 2) == []  # nothing recurs
    assert NgramProposer(min_n=1, max_n=5).propose([4, 5, 4], 4) == [5, 4]
    assert NgramProposer(min_n=2, max_n=5).propose(token_ids, 0) == []
    # matched up to max_n tokens: "1 2 3" first recurs before 4, "8 1 2 3" before 5, which max_n = 3 cannot see
    token_ids = [7, 1, 2, 3, 4, 8, 1, 2, 3, 5, 8, 1, 2, 3]
    assert NgramProposer(min_n=1, max_n=3).propose(token_ids, 1) == [4]
    assert NgramProposer(min_n=1, max_n=4).propose(token_ids, 1) == [5]


# -- the acceptance rule ----------------------------------------------------------------------
def test_drafts_are_kept_up_to_the_first_that_differs_from_its_rows_sample():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]  # all accepted, and the last row's token
    assert accept([5, 6], [4, 6, 7]) == [4]
    assert accept([], [3]) == [3]


def test_sampled_speculation_keeps_the_targets_distribution():
    """A draft verified by a sampled row: the first token emitted is distributed as the row's
    processed distribution (temperature, top-k), whatever the draft, and the token after an
    accepted draft as the next row's. The tolerance (5 sigma at 20,000 draws) fails the naive rule
    that accepts with probability p(draft) and redraws from p on rejection (draft included)."""
    torch.manual_seed(0)
    draws, tolerance = 20_000, 0.02
    temperature, top_k = 0.8, 3
    first = torch.tensor([2.0, 1.5, 1.0, 0.5, -1.0])  # the draft's row
    after = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])  # the row after the draft
    params = SamplingParams(temperature=temperature, top_k=top_k)

    def processed(logits):
        keep = logits >= logits.topk(top_k).values[-1]
        return torch.softmax(torch.where(keep, logits / temperature, float("-inf")), dim=-1)

    def emitted(draft: int) -> list[list[int]]:
        seqs = [Sequence([0], params) for _ in range(draws)]
        rows = [view for seq in seqs for view in (seq, seq.ahead([draft]))]
        logits = torch.stack([first, after]).repeat(draws, 1)
        sampled, _ = sample(logits, rows)
        return [accept([draft], sampled[2 * i : 2 * i + 2]) for i in range(draws)]

    p, q = processed(first), processed(after)
    for draft in (1, 0, 4):  # likely, most likely, outside the top-k
        out = emitted(draft)
        frequency = torch.bincount(torch.tensor([o[0] for o in out]), minlength=5) / draws
        assert (frequency - p).abs().max() < tolerance, (draft, frequency, p)
        seconds = torch.tensor([o[1] for o in out if len(o) == 2])
        if draft != 4:
            assert (torch.bincount(seconds, minlength=5) / len(seconds) - q).abs().max() < tolerance
        else:
            assert not len(seconds)  # never accepted: outside the top-k
    naive_draft = 1  # the naive rule's share of the draft, against p's
    naive = torch.rand(draws) < p[naive_draft]
    naive |= torch.multinomial(p, draws, replacement=True) == naive_draft
    assert abs(naive.float().mean() - p[naive_draft]) > tolerance


# -- the engine's output, unchanged -----------------------------------------------------------
def mixed_prompts() -> list[list[int]]:
    """Two sharing a 40-token prefix, a long one chunked beside the decodes, a short one."""
    prefix = [(7 * i) % 40000 + 100 for i in range(40)]
    return [prefix + [5], prefix + [8, 9], [(11 * i) % 40000 + 300 for i in range(300)], [21, 22, 23]]


def test_greedy_output_is_unchanged_batched_with_chunked_prefill_and_the_prefix_cache(make_engine, tiny_model):
    """Two rounds, the second's prompts each the first's prompt and output (a conversation going
    on): they hit the blocks speculating sequences filled, which must hold only verified tokens."""
    prompts = mixed_prompts()
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 17, 25, 9)]
    reference = make_engine(tiny_model, dtype="float64", enable_prefix_caching=False)
    want = outputs(reference, prompts, params)
    followups = [p + out[0]["tokens"] + [7, 8] for p, out in zip(prompts, want)]
    want_followups = outputs(reference, followups, params)
    engine = speculating(make_engine, tiny_model, want + want_followups, prompts + followups,
                         max_num_batched_tokens=64)
    assert tokens(outputs(engine, prompts, params)) == tokens(want)
    assert engine.kv.hit_tokens == 32  # the shared prefix's full blocks
    assert tokens(outputs(engine, followups, params)) == tokens(want_followups)
    assert engine.kv.hit_tokens - 32 > sum(len(p) // 16 * 16 for p in prompts)  # blocks holding outputs, too
    stats = engine.stats()
    assert 0 < stats["spec_decode_accepted_tokens_total"] < stats["spec_decode_draft_tokens_total"]


def test_single_requests_and_every_draft_length_give_the_same_tokens(make_engine, tiny_model):
    prompts = mixed_prompts()
    want = outputs(make_engine(tiny_model, dtype="float64"), prompts, GREEDY)
    for k in (1, 2, 7):
        engine = speculating(make_engine, tiny_model, want, prompts, k)
        assert [tokens(outputs(engine, [p], GREEDY))[0] for p in prompts] == tokens(want)
        assert engine.stats()["spec_decode_drafts_total"] > 0


def test_stops_and_max_tokens_within_accepted_drafts_emit_nothing_after_them(make_engine, tiny_model):
    prompt = [400 + 3 * i for i in range(20)]
    free = outputs(make_engine(tiny_model, dtype="float64"), [prompt], GREEDY)[0][0]["tokens"]
    stop_token = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(free[9],))
    cases = [(stop_token, ()), (SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), ())] + [
        (SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), ()) for m in (1, 2, 6, 13)]
    reference = make_engine(tiny_model, dtype="float64")
    text = outputs(reference, [prompt], GREEDY)[0][0]["text"]
    cases.append((GREEDY, (text[len(text) // 2 : len(text) // 2 + 3],)))  # a stop string midway
    for params, stop in cases:
        want = outputs(reference, [prompt], params, stop)
        engine = speculating(make_engine, tiny_model, [{0: {"tokens": free}}], [prompt], 7)
        got = outputs(engine, [prompt], params, stop)
        assert got == want
        assert engine.stats()["spec_decode_accepted_tokens_total"] > 0 or params.max_tokens <= 2
    assert want[0][0]["reason"] == "stop" and len(want[0][0]["text"]) < len(text)


def test_logprobs_penalties_min_tokens_and_logit_bias_see_each_draft_before_them(make_engine, tiny_model):
    """A verification row is processed as if the drafts before it were appended: frequency and
    presence counts, the repetition set and min_tokens' count include them. Here they decide every
    token: biased tokens take turns as the frequency penalty wears each down, and the stop token,
    barred until min_tokens, wins once it may."""
    prompts = mixed_prompts()[:2]
    biased, stop = (101, 202, 303), 404
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, repetition_penalty=1.2,
                            frequency_penalty=15.0, presence_penalty=1.0, min_tokens=9, stop_token_ids=(stop,),
                            logit_bias=((stop, 60.0), *((token, 100.0) for token in biased)))
    want = outputs(make_engine(tiny_model, dtype="float64"), prompts, params)
    assert all(len(out[0]["tokens"]) == 10 and out[0]["tokens"][-1] == stop for out in want)
    got = outputs(speculating(make_engine, tiny_model, want, prompts), prompts, params)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        assert len(g[0]["logprobs"]) == len(g[0]["tokens"])
        for a, b in zip(g[0]["logprobs"], w[0]["logprobs"]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_seeded_sampling_is_the_same_with_speculation_and_whatever_the_batch(make_engine, tiny_model):
    """A seeded row's noise is keyed by its position, so verifying a draft there draws what an
    ordinary decode would have: seeded output is exactly that without speculation, n > 1 too."""
    prompts = mixed_prompts()
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, n=3, ignore_eos=True)
    want = outputs(make_engine(tiny_model, dtype="float64"), prompts[:2], seeded)
    engine = speculating(make_engine, tiny_model, want, prompts[:2])
    assert tokens(outputs(engine, prompts[:2], seeded)) == tokens(want)
    unseeded = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
    mixed = outputs(engine, [prompts[2], prompts[0], prompts[3]], [unseeded, seeded, unseeded])
    assert tokens(mixed)[1] == tokens(want)[0]
    assert engine.stats()["spec_decode_accepted_tokens_total"] > 0


def test_preemption_and_aborts_leak_no_blocks(make_engine, tiny_model):
    prompts = [[100 + 13 * i + j for j in range(40)] for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = outputs(make_engine(tiny_model, dtype="float64"), prompts, params)
    small = speculating(make_engine, tiny_model, want, prompts, num_kv_blocks=12)  # 6 requests need 30 blocks
    assert tokens(outputs(small, prompts, params)) == tokens(want)
    assert small.scheduler.num_preemptions > 0 and small.stats()["spec_decode_accepted_tokens_total"] > 0
    small.add_request("aborted", prompts[0], params)
    while not small.scheduler.running or not small.scheduler.running[0].num_output_tokens > 3:
        small.step()
    small.abort("aborted")  # make_engine's teardown checks that no block is left behind


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 24)), min_size=1, max_size=6),
    num_blocks=st.integers(8, 24),
    budget=st.sampled_from([8, 32, 256]),
    k=st.integers(1, 6),
)
def test_speculation_with_eviction_and_preemption_never_changes_outputs(make_engine, tiny_model, data, num_blocks,
                                                                       budget, k):
    """Random mixes of requests sharing prefixes, on a KV cache small enough to evict and preempt,
    twice (the second round hits what the first cached): the outputs of an unconstrained engine."""
    prefixes = [[(31 * g + i) % 49000 + 50 for i in range(16 * (g + 1))] for g in range(4)]
    prompts = [prefixes[g][: 16 * (g + 1)] + [1000 + j for j in range(extra)] for g, extra, _ in data]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, _, m in data]
    want = outputs(make_engine(tiny_model, dtype="float64", enable_prefix_caching=False), prompts, params)
    need = max(-(-(len(p) + m) // 16) for p, (_, _, m) in zip(prompts, data))
    engine = speculating(make_engine, tiny_model, want, prompts, k, num_kv_blocks=max(num_blocks, need),
                         max_num_batched_tokens=budget)
    for _ in range(2):
        assert tokens(outputs(engine, prompts, params)) == tokens(want)


def test_drafts_take_only_free_blocks_and_never_preempt(make_engine, tiny_model):
    prompts = [[100 + i for i in range(31)], [200 + i for i in range(32)]]  # 2 blocks each, 1 of 5 left
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = outputs(make_engine(tiny_model, dtype="float64"), prompts, params)
    engine = speculating(make_engine, tiny_model, want, prompts, num_kv_blocks=5)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()
    engine.step()  # the first's token fits its second block, the second's takes the last free one
    # the first's drafts would need another block: it does not speculate; the second's fit its new block
    assert engine.scheduler.num_preemptions == 0 and engine.stats()["spec_decode_drafts_total"] == 1
    while engine.has_work:
        engine.step()
    engine.scheduler.proposer = Oracle([p + out[0]["tokens"] for p, out in zip(prompts, want)])
    assert tokens(outputs(engine, prompts, params)) == tokens(want)  # preempted in turn, and speculating


def test_a_sequence_with_a_grammar_does_not_speculate(make_engine, tiny_model):
    class Repeating:
        def propose(self, token_ids: list[int], k: int) -> list[int]:
            return token_ids[-k:]

    engine = make_engine(tiny_model, dtype="float64", num_speculative_tokens=4)
    engine.scheduler.proposer = Repeating()
    params = SamplingParams(max_tokens=12, temperature=0.0, grammar=Constraint("regex", "[a-z]{3,40}"))
    engine.generate([[300, 301, 302]], params)
    assert engine.stats()["spec_decode_drafts_total"] == 0
    engine.generate([[300, 301, 302]], GREEDY)
    assert engine.stats()["spec_decode_drafts_total"] > 0


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=0)
    with pytest.raises(ValueError, match="more than prompt_lookup_max"):
        EngineConfig(prompt_lookup_min=4, prompt_lookup_max=3)


# -- the default model, copying for real ----------------------------------------------------------
COPY_TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
             "the members agreed to increase funding for the public library, to repair the roof of the town "
             "hall, and to hire two more teachers for the primary school. The proposal to build a new parking "
             "lot was postponed until the spring, when the council will have more information about the costs.")


def copy_prompts(tokenizer) -> list[list[int]]:
    asks = [f"Repeat the following text exactly, word for word:\n\n{COPY_TEXT}",
            f"Fix the typos in this text and return it:\n\n{COPY_TEXT.replace('the ', 'teh ', 3)}",
            "Write a short poem about the sea."]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                                          add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False) for ask in asks]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, attention", [("float32", "native"), ("float32", "torch"), ("auto", "auto")])
def test_the_default_model_copies_several_tokens_a_step_and_says_the_same(make_engine, default_model, dtype,
                                                                         attention):
    """Batched with prompts chunked, and alone; each path (native kernels, PyTorch, and what serves
    by default: bfloat16 where the CPU has it) against itself without speculation, token for token:
    a verifying row is computed as a decode step computes it."""
    prompts = copy_prompts(default_model.tokenizer)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    want = outputs(make_engine(dtype=dtype, attention=attention), prompts, params)
    engine = make_engine(dtype=dtype, attention=attention, num_speculative_tokens=5, max_num_batched_tokens=128)
    assert tokens(outputs(engine, prompts, params)) == tokens(want)
    alone = make_engine(dtype=dtype, attention=attention, num_speculative_tokens=5)
    assert tokens(outputs(alone, prompts[:1], params)) == tokens(want[:1])
    stats = alone.stats()
    assert stats["spec_decode_accepted_tokens_total"] / stats["spec_decode_draft_tokens_total"] > 0.5
    assert (len(want[0][0]["tokens"]) - 1) / (alone.steps - 1) > 2  # tokens per decode step, after the prefill
