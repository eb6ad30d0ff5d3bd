"""Speculative decoding eval: lossless greedy, accept/bonus/crop bookkeeping, sampling, CLI."""

import copy
import json
import random
from collections import Counter

import pytest
import torch
from helpers import (
    acceptance_by_hand,
    family_target,
    greedy_reference,
    tiny_drafter,
    varied_target,
    word_tokenizer,
)
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache

from dflash.decode.baseline import GreedyBaselines
from dflash.decode.evaluate import (
    describe_divergences,
    divergence,
    encode_prompt,
    load_prompts,
    tau,
)
from dflash.decode.speculative import (
    DecodeSettings,
    accept,
    croppable,
    greedy_generate,
    speculative_generate,
    with_cache,
)
from dflash.eval import main
from dflash.model.drafter import FULL, SLIDING, TargetHead
from dflash.model.export import save_export
from dflash.objective.masks import build_mask

pytestmark = pytest.mark.usefixtures("one_thread")

B = 4
VOCAB = 96
MAX_NEW = 30


@pytest.fixture(scope="module")
def target() -> nn.Module:
    return varied_target(vocab=VOCAB)


def prompt(seed: int, length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(seed))


class ScriptedDrafter(nn.Module):
    """Proposes ``proposals[position]`` for each block slot, and checks on every call
    that its context is exactly the target's hidden states of the accepted prefix, or of
    its last ``context`` positions."""

    def __init__(self, config, proposals: list[int], reference_features: torch.Tensor, context: int | None = None):
        super().__init__()
        self.config = config
        self.proposals = torch.tensor(proposals)
        self.reference_features = reference_features
        self.keep = context

    def context(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return features  # checked as they are: no projection

    def forward(self, ctx_features, block_embeds, ctx_positions, block_positions, mask=None, projected=False):
        p = int(block_positions[0, 0])
        first = 0 if self.keep is None else max(0, p - self.keep)
        assert mask is None and torch.equal(ctx_positions[0], torch.arange(first, p))
        assert torch.equal(block_positions[0], torch.arange(p, p + self.config.block_size))
        torch.testing.assert_close(ctx_features, self.reference_features[:, first:p], atol=1e-4, rtol=1e-4)
        return block_positions[..., None].float()  # the "hidden state" carries the position

    def draft_logits(self, head, hidden: torch.Tensor) -> torch.Tensor:
        return head.logits(hidden).float()


class ScriptedHead:
    """Turns a ScriptedDrafter's positions into one-hot logits of its proposals."""

    def __init__(self, proposals: torch.Tensor):
        self.proposals = proposals

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.one_hot(self.proposals[hidden[..., 0].long()], VOCAB).float()


def scripted(target, prompt_ids, corrupt: set[int], context: int | None = None, **attention):
    """Drafter + head proposing the target's greedy continuation, wrong at ``corrupt`` positions;
    its config has the layer types of ``attention``, so it must be given ``context`` positions.

    The continuation runs B tokens past MAX_NEW so every proposal has a true value.
    """
    sequence = prompt_ids[0].tolist() + greedy_generate(target, prompt_ids, MAX_NEW + B)
    proposals = [(t + 1) % VOCAB if pos in corrupt else t for pos, t in enumerate(sequence)]
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = torch.cat([hs[i + 1] for i in (1, 2, 3)], dim=-1)
    drafter = ScriptedDrafter(tiny_drafter(vocab=VOCAB, block_size=B, **attention).config, proposals, features, context)
    return drafter, ScriptedHead(drafter.proposals), sequence[prompt_ids.shape[1]:]


def reference_acceptance(greedy: list[int], proposals: list[int], prompt_len: int, eos_ids=()) -> list[int]:
    """Acceptance lengths by hand (:func:`helpers.acceptance_by_hand`); ``proposals`` cover the prompt too."""
    return acceptance_by_hand(greedy, proposals[prompt_len:], B, MAX_NEW, eos_ids)[0]


def test_greedy_is_lossless_with_a_random_drafter(target):
    drafter, head = tiny_drafter(vocab=VOCAB, block_size=B).eval(), TargetHead.of(target)
    acceptance = []
    for seed in range(3):
        ids = prompt(seed)
        tokens, lengths = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW, eos_ids={VOCAB + 7})
        assert tokens == greedy_generate(target, ids, MAX_NEW)
        assert len(tokens) == MAX_NEW and 0 <= 1 + sum(lengths) - MAX_NEW < B
        acceptance.append(lengths)
    assert 1.0 <= tau(acceptance) < 1.5


def test_perfect_oracle_accepts_whole_blocks(target):
    ids = prompt(0)
    drafter, head, greedy = scripted(target, ids, corrupt=set())
    tokens, lengths = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW)
    assert tokens == greedy[:MAX_NEW]
    assert lengths == [B] * -(-(MAX_NEW - 1) // B)


def test_acceptance_matches_a_hand_written_loop(target):
    ids = prompt(1)
    corrupt = set(random.Random(0).sample(range(ids.shape[1], ids.shape[1] + MAX_NEW + B), 12))
    drafter, head, greedy = scripted(target, ids, corrupt)
    tokens, lengths = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW)
    assert tokens == greedy[:MAX_NEW]
    assert lengths == reference_acceptance(greedy, drafter.proposals.tolist(), ids.shape[1])
    assert len(set(lengths)) > 2  # the corruptions exercise several acceptance lengths


@pytest.mark.parametrize("window,context", [(3, 2), (1, 0), (40, 39)])
def test_a_sliding_drafter_sees_its_window_and_accepts_as_a_hand_written_loop(target, window, context):
    """Every layer slides: the drafter is given the last ``window - 1`` context positions,
    what its first slot's window reaches; acceptance is counted as without a window."""
    ids = prompt(4)
    corrupt = set(random.Random(1).sample(range(ids.shape[1], ids.shape[1] + MAX_NEW + B), 12))
    drafter, head, greedy = scripted(target, ids, corrupt, context, layer_types=[SLIDING] * 2, sliding_window=window)
    tokens, lengths = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW)
    assert tokens == greedy[:MAX_NEW]
    assert lengths == reference_acceptance(greedy, drafter.proposals.tolist(), ids.shape[1])
    assert len(set(lengths)) > 2


@pytest.mark.parametrize("layer_types", [[SLIDING] * 2, [SLIDING, FULL]], ids=["all-sliding", "mixed"])
def test_sliding_drafter_decodes_losslessly_with_its_training_forward(target, layer_types):
    """Float64 decoding with a real sliding drafter: greedy output equals plain greedy, and
    every cycle's drafter forward (its window applied at inference) equals the training
    forward of that block under the windowed mask, over the target's features of the
    whole sequence."""
    target64, window = copy.deepcopy(target).double(), 3
    drafter = tiny_drafter(vocab=VOCAB, block_size=B, layer_types=layer_types, sliding_window=window).double().eval()
    drafter.reset_parameters(0.2)
    head, ids = TargetHead.of(target64), prompt(5)
    calls = []

    def record(module, args, output):
        calls.append((args[3][0, 0].item(), args[1].clone(), output.clone()))

    hook = drafter.register_forward_hook(record)
    tokens, lengths = speculative_generate(target64, drafter, head, ids, max_new_tokens=MAX_NEW)
    hook.remove()
    assert tokens == greedy_generate(target64, ids, MAX_NEW) and len(lengths) == len(calls) > 5
    sequence = torch.cat([ids, torch.tensor([tokens])], dim=1)
    with torch.no_grad():
        hs = target64(input_ids=sequence, output_hidden_states=True).hidden_states
        features = torch.cat([hs[i + 1] for i in (1, 2, 3)], dim=-1)
        n = features.shape[1]
        for p, embeds, hidden in calls:
            anchors = torch.tensor([[p]])
            masks = {FULL: build_mask(anchors, n, B, False), SLIDING: build_mask(anchors, n, B, False, window)}
            trained = drafter(features, embeds, torch.arange(n)[None], torch.arange(p, p + B)[None], masks)
            torch.testing.assert_close(hidden, trained, rtol=1e-9, atol=1e-11, msg=f"block at {p}")


def test_stops_at_eos_and_truncates(target):
    ids = prompt(2)
    drafter, head, greedy = scripted(target, ids, corrupt=set())
    eos = greedy[6]  # mid-block: the cycle that accepts it also accepts tokens after it
    tokens, _ = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW, eos_ids={eos})
    assert tokens == greedy[: greedy.index(eos) + 1]
    assert tokens == greedy_generate(target, ids, MAX_NEW, {eos})


def test_a_stop_token_accepted_among_the_drafts_ends_the_cycles(target):
    """The cycle whose accepted drafts hold the first stop token is the last: its tokens
    after the stop are cut, neither counted (z-lab's harness) nor followed by a cycle, so
    tau and the histogram count only the tokens that made the response."""
    ids = prompt(4)
    corrupt = {ids.shape[1] + 2}  # one rejection first, so the cycles do not start on the block grid
    drafter, head, greedy = scripted(target, ids, corrupt)
    proposals = drafter.proposals.tolist()
    eos = next(t for i, t in enumerate(greedy[:MAX_NEW]) if t not in greedy[:i]
               and acceptance_by_hand(greedy, proposals[ids.shape[1]:], B, MAX_NEW, {t})[1] == "draft"
               and i > B)
    tokens, lengths = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW, eos_ids={eos})
    assert tokens == greedy[: greedy.index(eos) + 1]
    assert lengths == reference_acceptance(greedy, proposals, ids.shape[1], {eos})
    assert 1 + sum(lengths) == len(tokens)  # the last cycle counted to its stop, not the drafts accepted past it
    assert len(lengths) < len(reference_acceptance(greedy, proposals, ids.shape[1]))


def test_sampling_is_seeded_and_in_vocab(target):
    drafter, head, ids = tiny_drafter(vocab=VOCAB, block_size=B).eval(), TargetHead.of(target), prompt(3)

    def run(seed):
        return speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW, temperature=1.0,
                                    generator=torch.Generator().manual_seed(seed))

    tokens, lengths = run(0)
    assert len(tokens) == MAX_NEW and all(0 <= t < VOCAB for t in tokens)
    assert all(1 <= n <= B for n in lengths)
    assert run(0) == (tokens, lengths)
    assert run(1)[0] != tokens


def test_speculative_sampling_keeps_the_target_distribution():
    """The first emitted token (accepted draft or resampled) is distributed as the target's p."""
    p_logits = torch.tensor([2.0, 0.5, 0.0, -1.0])
    q_logits = torch.tensor([0.0, 1.5, 0.5, 0.0])
    g = torch.Generator().manual_seed(0)
    trials, counts = 8000, Counter()
    for _ in range(trials):
        draft = torch.multinomial(q_logits.softmax(-1), 1, generator=g)
        n, bonus = accept(draft, q_logits[None], torch.stack([p_logits, p_logits]), 1.0, generator=g)
        counts[int(draft) if n else bonus] += 1
    freq = torch.tensor([counts[i] / trials for i in range(4)])
    torch.testing.assert_close(freq, p_logits.softmax(-1), atol=0.02, rtol=0)


def save_tiny_target(model: nn.Module, out) -> None:
    """A word-level tokenizer with a Qwen-style chat template next to the model."""
    tokenizer = word_tokenizer(VOCAB)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def test_cli_writes_the_report(target, tmp_path):
    save_tiny_target(target, tmp_path / "target")
    save_export(tiny_drafter(vocab=VOCAB, block_size=B), tmp_path / "run" / "export", dtype="float32")
    turns = [[{"role": "user", "content": f"w{i} w{i + 1} w{2 * i}"}, {"role": "assistant", "content": "w3"}] for i in range(4)]
    lines = [{"conversations": t} for t in turns]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    main([
        "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "run" / "export"),
        "--data", f"toy={tmp_path / 'p.jsonl'}", "--max-prompts", "3", "--max-new-tokens", "12",
        "--temperature", "0", "1", "--device", "cpu",
    ])
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["lossless"] is True and report["block_size"] == B
    greedy, sampled = report["results"]["toy@0"], report["results"]["toy@1"]
    assert greedy["lossless"] is True and sampled["lossless"] is None
    assert greedy["divergences"] == [] and sampled["divergences"] is None
    assert greedy["prompts"] == 3 and 0 < greedy["new_tokens"] <= 36
    assert set(greedy["histogram"]) == {"1", "2", "3", "4"}
    assert sum(greedy["histogram"].values()) == greedy["cycles"]
    assert report["tau"] == greedy["tau"]


def test_prompts_in_any_training_format(tmp_path):
    """Held-out prompts read like training data: a JSON list of prompt/response pairs and
    a JSONL with a broken line (skipped) both give the turns before the reply."""
    (tmp_path / "a.json").write_text(json.dumps([{"prompt": "w1 w2", "response": "w3"}, {"prompt": "w4"}]))
    (tmp_path / "b.jsonl").write_text("{broken\n" + json.dumps({"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]}) + "\n")
    assert load_prompts(str(tmp_path / "a.json"), 8) == [[{"role": "user", "content": "w1 w2"}],
                                                         [{"role": "user", "content": "w4"}]]
    assert load_prompts(str(tmp_path / "b.jsonl"), 8) == [[{"role": "system", "content": "s"},
                                                          {"role": "user", "content": "w5"}]]


def test_a_prompt_set_without_prompts_is_named_by_its_setting(tmp_path):
    (tmp_path / "broken.jsonl").write_text("{broken\n")
    with pytest.raises(ValueError, match="data.eval_path='.*broken.jsonl' holds no prompts"):
        load_prompts(str(tmp_path / "broken.jsonl"), 8)
    with pytest.raises(FileNotFoundError, match="--data='.*absent.jsonl' does not exist"):
        main(["--target", "demo", "--drafter", str(tmp_path), "--data", f"heldout={tmp_path / 'absent.jsonl'}"])


def test_prompts_are_rendered_with_the_training_template_arguments():
    from dflash.model.target import TargetSource

    tokenizer = TargetSource("demo").tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    messages = [{"role": "user", "content": "count from 1 to 3"}]
    plain = encode_prompt(tokenizer, messages)
    no_thinking = encode_prompt(tokenizer, messages, {"enable_thinking": False})
    assert no_thinking.shape[1] > plain.shape[1]
    assert torch.equal(no_thinking[:, : plain.shape[1]], plain)


def test_a_divergence_is_located_and_measured_by_the_target(target):
    """Where a speculative output departs from plain greedy, and the target's logit margin
    between the two tokens there, against the logits of the incremental greedy decode."""
    ids = prompt(2)
    greedy = greedy_generate(target, ids, MAX_NEW)
    assert divergence(target, ids, greedy, list(greedy)) is None
    at, cache = 5, DynamicCache(config=target.config)
    logits = with_cache(target, cache, input_ids=ids).logits[0, -1]
    for t in greedy[:at]:  # the target's logits after the prompt and greedy[:at], one token at a time
        logits = with_cache(target, cache, input_ids=torch.tensor([[t]])).logits[0, -1]
    logits = logits.double()
    runner_up = int(logits.topk(2).indices[1])
    assert int(logits.argmax()) == greedy[at] != runner_up
    other = greedy[:at] + [runner_up] + greedy[at + 1:]
    found = divergence(target, ids, greedy, other)
    assert found["token"] == at
    assert found["margin"] == pytest.approx(float(logits[greedy[at]] - logits[runner_up]), abs=1e-4)
    assert found["margin"] > 0
    assert "1 of 4 prompts" in describe_divergences([{"prompt": 2, **found}], 4)


def test_a_kept_greedy_baseline_is_reused_not_decoded_again(target, monkeypatch, tmp_path):
    """Evaluations while training keep the frozen target's greedy outputs: the second
    evaluation reuses them and reports the same lossless check; so does a later one that
    reads them from their file (a resumed run)."""
    import dflash.decode.batch as batch_module
    import dflash.decode.evaluate as eval_module

    tokenizer, drafter, head = word_tokenizer(VOCAB), tiny_drafter(vocab=VOCAB, block_size=B).eval(), TargetHead.of(target)
    prompts = [[{"role": "user", "content": f"w{i} w{i + 3}"}] for i in range(3)]
    kept = GreedyBaselines(tmp_path / "greedy_baseline.json")
    budget = DecodeSettings(max_new_tokens=12)
    first = eval_module.evaluate(target, tokenizer, drafter, head, prompts=prompts, settings=budget, baselines=kept)
    assert len(kept.outputs) == 3 and first["lossless"] is True

    def no_decoding(*args, **kwargs):
        raise AssertionError("the kept baseline was decoded again")

    monkeypatch.setattr(batch_module, "greedy_batch_steps", no_decoding)
    for baselines in (kept, GreedyBaselines(tmp_path / "greedy_baseline.json")):
        again = eval_module.evaluate(target, tokenizer, drafter, head, prompts=prompts, settings=budget,
                                     baselines=baselines)
        assert again["lossless"] is True and again["tau"] == first["tau"] and again["new_tokens"] == first["new_tokens"]
    key = next(iter(kept.outputs))
    kept.outputs[key] = kept.outputs[key][:-1] + [(kept.outputs[key][-1] + 1) % VOCAB]  # reported, not re-decoded
    assert eval_module.evaluate(target, tokenizer, drafter, head, prompts=prompts, settings=budget,
                                baselines=kept)["lossless"] is False


# ---------------------------------------------------------------------------
# Targets whose cache cannot be cropped: sliding windows, linear attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("gemma3", torch.float32), ("gpt_oss", torch.float32),
                                        ("qwen3_5", torch.float64)])
def test_a_cache_that_cannot_be_cropped_is_rolled_back_exactly(name, dtype):
    """Sliding-window (window 4 < context) and linear-attention layers: after every
    rejection the cache is put back to the block start and fed the accepted tokens, so the
    drafter's context stays the target's hidden states of the accepted prefix (checked on
    every call), the output is plain greedy decoding without a cache, and acceptance is
    counted as by hand over many acceptance lengths. Linear attention in float64: it runs a
    chunked kernel over a whole sequence and a recurrent one token by token, whose float32
    results differ by ~1e-4 at these weights."""
    target = family_target(name, num_layers=6, vocab=VOCAB).to(dtype)
    ids = prompt(5)
    corrupt = set(random.Random(2).sample(range(ids.shape[1], ids.shape[1] + MAX_NEW + B), 12))
    drafter, head, greedy = scripted(target, ids, corrupt)
    tokens, lengths = speculative_generate(target, drafter, head, ids, max_new_tokens=MAX_NEW)
    assert tokens == greedy[:MAX_NEW] == greedy_reference(target, ids[0].tolist(), ids.shape[1] + MAX_NEW)[ids.shape[1]:]
    assert lengths == reference_acceptance(greedy, drafter.proposals.tolist(), ids.shape[1])
    assert len(set(lengths)) > 2


@pytest.mark.parametrize("name,expected", [("qwen3", True), ("llama3", True), ("gemma3", False), ("qwen3_5", False)])
def test_only_caches_of_plain_key_value_layers_are_cropped(name, expected):
    target = family_target(name, num_layers=6, vocab=VOCAB)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        with_cache(target, cache, input_ids=prompt(0))
    assert croppable(cache) is expected
