"""Build the embedded default assets: a tiny target LM and demo chat data.

Why this exists: DFlash trains a drafter against a *target* model. Tests, the
quick-start and CPU smoke runs need a target that (a) is a real Hugging Face
causal LM loadable offline, (b) is small enough to ship in the repository and
(c) produces structured, prompt-dependent continuations, so that a drafter can
actually learn to predict them (acceptance length tau well above 1) within a
few minutes of CPU training. Random-init models fail (c): their greedy output
is a single-token loop, which makes every drafter look perfect.

The script therefore:

1. samples prompts from a small synthetic task grammar (counting up, down
   and in steps, times tables, letter ranges, repeating a word) whose correct
   answer is a deterministic function of the prompt;
2. builds a word-level tokenizer with a Qwen-style chat template;
3. trains a tiny ``Qwen3ForCausalLM`` from scratch on CPU until greedy
   decoding solves the tasks;
4. saves it to ``dflash/assets/demo_target/``;
5. regenerates the assistant turns of the demo data with that target (greedy),
   exactly like the data-regeneration step of a real drafter pipeline, and
   writes ``dflash/assets/demo_data/{train,heldout}.jsonl``.

Design notes, from sweeps of this exact model shape: the budget is ~8 minutes
of training on 2 CPU cores (2800 steps of 16 conversations). In that budget the
model reliably learns tasks whose answer follows local rules (successor of a
number, next letter, next times-table row) once it has read a few small
parameters off the prompt (start, end, step, ...). Tasks that copy or reverse
word lists need induction heads and stayed near 0% exact match, so they are not
in the grammar; numbers stop at 199 so that every number token is seen often.

Everything is seeded, so reruns on the same torch build give the same assets.
Run from the repository root: ``python tools/build_demo_assets.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS_DIR = REPO_ROOT / "dflash" / "assets"
TARGET_DIR = ASSETS_DIR / "demo_target"
DATA_DIR = ASSETS_DIR / "demo_data"

SEED = 20240611
NUM_THREADS = 2
NUM_TRAIN_CONVERSATIONS = 3000
NUM_HELDOUT_CONVERSATIONS = 64
MAX_NEW_TOKENS = 200
LOG_EVERY = 100  # training steps between progress lines

# ---------------------------------------------------------------------------
# Task grammar
# ---------------------------------------------------------------------------

MAX_NUMBER = 199
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Content words for the repeat task. They must not collide with the words used
# in the instructions, otherwise a prompt such as "repeat table 3 times" would
# be ambiguous (checked in `build_vocab`).
WORDS = """
apple banana cherry grape lemon mango orange peach pear plum melon berry
cat dog horse mouse tiger lion bear wolf fox rabbit sheep goat duck goose
owl eagle snake frog whale shark fish crab bee ant
red blue green yellow purple black white brown pink gray gold silver
river mountain forest ocean desert island valley meadow lake garden hill
beach cloud rain snow wind storm sun moon star sky
house chair bed lamp clock mirror window door roof wall floor kitchen
book pen paper letter box bag cup plate spoon fork knife bottle
car bus train boat plane bike road bridge city town village street
happy sad quick slow big small tall short warm cold bright dark soft loud
run jump swim fly sing dance read write cook paint sleep dream walk
king queen child friend doctor farmer teacher pilot baker sailor
bread cheese milk honey rice soup cake salt sugar tea coffee water
""".split()

# The times-table sign ("7 x 3 = 21") is deliberately the letter token "x".
TIMES_SIGN = "x"


@dataclass(frozen=True)
class Example:
    """One task instance: the user prompt and the grammar's correct answer."""

    kind: str
    prompt: str
    answer: str


def _count_up(rng: random.Random, size: int) -> Example:
    """'count from 37 to 58' -> '37 38 ... 58' (`size` numbers)."""
    start = rng.randint(0, MAX_NUMBER - (size - 1))
    end = start + size - 1
    answer = " ".join(str(n) for n in range(start, end + 1))
    return Example("count_up", f"count from {start} to {end}", answer)


def _count_down(rng: random.Random, size: int) -> Example:
    """'count down from 58 to 37' -> '58 57 ... 37' (`size` numbers)."""
    end = rng.randint(0, MAX_NUMBER - (size - 1))
    start = end + size - 1
    answer = " ".join(str(n) for n in range(start, end - 1, -1))
    return Example("count_down", f"count down from {start} to {end}", answer)


def _count_step(rng: random.Random, size: int) -> Example:
    """'count by 5 from 35 to 180' -> '35 40 ... 180' (`size` multiples of the step)."""
    step = rng.choice([2, 3, 5])
    start = step * rng.randint(0, MAX_NUMBER // step - (size - 1))
    end = start + (size - 1) * step
    answer = " ".join(str(n) for n in range(start, end + 1, step))
    return Example("count_step", f"count by {step} from {start} to {end}", answer)


def _times_table(rng: random.Random, size: int) -> Example:
    """'times table of 7 from 3 to 9' -> '7 x 3 = 21 , 7 x 4 = 28 , ...' (`size` rows)."""
    base = rng.randint(2, 12)
    first = rng.randint(1, 13 - size)
    last = first + size - 1
    answer = " , ".join(
        f"{base} {TIMES_SIGN} {k} = {base * k}" for k in range(first, last + 1)
    )
    return Example("times_table", f"times table of {base} from {first} to {last}", answer)


def _alphabet(rng: random.Random, size: int) -> Example:
    """'5 letters from g' -> '1 g , 2 h , 3 i , 4 j , 5 k' (`size` letters).

    Half of the runs go backwards ('5 letters down from k'). The length is a
    count, like in the repeat task, because a tiny model learns "stop when the
    counter reaches the number in the prompt" far more reliably than "stop at
    the prompt's end letter" (an earlier 'letters from g to k' version stayed
    at 50-75% exact match, overshooting the end letter).
    """
    low = rng.randint(0, 26 - size)
    indices = list(range(low, low + size))
    direction = ""
    if rng.random() < 0.5:
        indices.reverse()
        direction = " down"
    answer = " , ".join(f"{n} {LETTERS[i]}" for n, i in enumerate(indices, start=1))
    prompt = f"{size} letters{direction} from {LETTERS[indices[0]]}"
    return Example("alphabet", prompt, answer)


def _repeat(rng: random.Random, size: int) -> Example:
    """'repeat owl 3 times' -> '1 : owl , 2 : owl , 3 : owl' (`size` repetitions).

    The explicit counter and the single-word phrase keep the task learnable for
    a tiny model: longer phrases (like copying or reversing word lists) need
    induction heads, which did not form within the CPU training budget.
    """
    word = rng.choice(WORDS)
    answer = " , ".join(f"{i} : {word}" for i in range(1, size + 1))
    return Example("repeat", f"repeat {word} {size} times", answer)


@dataclass(frozen=True)
class Task:
    """A task kind and its size ranges (inclusive).

    `demo_sizes` gives the shipped conversations their 20-80 token responses.
    `short_sizes` are extra-small instances mixed into the target's training
    stream only: what a tiny model finds hard is reading the start, the end and
    the content off the prompt, not emitting the middle of a long answer, so
    short instances give far more of that learning signal per CPU second.
    """

    make: Callable[[random.Random, int], Example]
    demo_sizes: tuple[int, int]
    short_sizes: tuple[int, int]


TASKS: dict[str, Task] = {
    "count_up": Task(_count_up, (20, 80), (2, 19)),
    "count_down": Task(_count_down, (20, 80), (2, 19)),
    "count_step": Task(_count_step, (20, 30), (2, 19)),
    "times_table": Task(_times_table, (4, 12), (1, 3)),
    "alphabet": Task(_alphabet, (7, 26), (2, 6)),
    "repeat": Task(_repeat, (6, 20), (1, 5)),
}
SHORT_FRACTION = 0.25  # share of short instances in the target's training stream
INSTRUCTION_WORDS = """
count from to down by times table of letters repeat
""".split()
PUNCTUATION = [",", ":", "="]


def sample_example(rng: random.Random, kind: str | None = None, short: bool = False) -> Example:
    """Sample one example of `kind` (default: a uniformly chosen kind)."""
    task = TASKS[kind or rng.choice(list(TASKS))]
    low, high = task.short_sizes if short else task.demo_sizes
    return task.make(rng, rng.randint(low, high))


def sample_unique(
    rng: random.Random, count: int, exclude: set[str], kind: str | None = None
) -> list[Example]:
    """Sample `count` demo-size examples with distinct prompts not in `exclude`."""
    seen = set(exclude)
    examples: list[Example] = []
    while len(examples) < count:
        ex = sample_example(rng, kind)
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            examples.append(ex)
    return examples


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------

PAD_TOKEN = "<|endoftext|>"  # the pad token, as in Qwen
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|MASK|>"  # in the vocab for the drafter, never in any data
UNK_TOKEN = "<|unk|>"  # required by WordLevel; never produced by the grammar
NEWLINE = "\n"  # the chat template's only whitespace besides spaces
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN, UNK_TOKEN]
VOCAB_MULTIPLE = 8

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_vocab() -> list[str]:
    """All tokens in id order, padded with reserved tokens to a multiple of 8.

    Padding the *tokenizer* (not just the embedding) keeps len(tokenizer) equal
    to config.vocab_size, which avoids off-by-padding surprises downstream.
    """
    words = (
        SPECIAL_TOKENS
        + [NEWLINE, "user", "assistant"]
        + PUNCTUATION
        + [str(n) for n in range(MAX_NUMBER + 1)]
        + list(LETTERS)
        + INSTRUCTION_WORDS
        + WORDS
    )
    duplicates = [w for w, c in Counter(words).items() if c > 1]
    assert not duplicates, f"vocabulary collisions: {duplicates}"
    padded = math.ceil(len(words) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return words + [f"<|reserved_{i}|>" for i in range(padded - len(words))]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer: split on spaces, '\\n' is its own (added) token.

    Decoding joins tokens with single spaces, which reproduces every grammar
    string exactly because those are single-space separated by construction.
    """
    vocab = build_vocab()
    backend = Tokenizer(
        models.WordLevel({tok: i for i, tok in enumerate(vocab)}, unk_token=UNK_TOKEN)
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    reserved = [t for t in vocab if t.startswith("<|reserved_")]
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + reserved]
    )
    # An added token is matched before pre-tokenization, so "\n" survives the
    # whitespace split instead of being swallowed by it.
    backend.add_tokens([AddedToken(NEWLINE, special=False, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,  # a turn ends with it, as Qwen3's chat models do: decoding stops there
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    assert len(tokenizer) == len(vocab)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Save so that both transformers 5.x and 4.57+ (pyproject's floor) load it.

    transformers 5 writes a class name and a special-token key that 4.x does
    not know (`TokenizersBackend`, a list under `extra_special_tokens`) and
    puts the chat template in a separate chat_template.jinja. The names below
    are understood by both major versions.
    """
    tokenizer.save_pretrained(directory, save_jinja_files=False)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens")
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    config_path.write_text(text, encoding="utf-8")


def chat(user: str, assistant: str | None = None) -> list[dict[str, str]]:
    """Messages for one single-turn conversation."""
    messages = [{"role": "user", "content": user}]
    if assistant is not None:
        messages.append({"role": "assistant", "content": assistant})
    return messages


def encode_conversation(
    tokenizer: PreTrainedTokenizerFast, user: str, assistant: str
) -> tuple[list[int], list[int]]:
    """Token ids of the generation prompt and of the full conversation."""
    prompt = tokenizer.apply_chat_template(chat(user), add_generation_prompt=True)
    full = tokenizer.apply_chat_template(chat(user, assistant))
    return prompt["input_ids"], full["input_ids"]


def check_conversation(tokenizer: PreTrainedTokenizerFast, user: str, assistant: str) -> None:
    """Assert the properties the drafter pipeline relies on.

    The generation-prompt ids must be an exact prefix of the full conversation
    ids (so loss masks can be computed by length), the response must decode
    back to the same text, and no data may contain <|MASK|> or <|unk|>.
    """
    prompt_ids, full_ids = encode_conversation(tokenizer, user, assistant)
    assert full_ids[: len(prompt_ids)] == prompt_ids, (user, assistant)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    response_ids = full_ids[len(prompt_ids) :]
    assert response_ids[-2:] == [im_end, tokenizer.convert_tokens_to_ids(NEWLINE)]
    assert tokenizer.decode(response_ids[:-2]) == assistant, (user, assistant)
    forbidden = {tokenizer.mask_token_id, tokenizer.unk_token_id}
    assert not forbidden.intersection(full_ids), (user, assistant)


# ---------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    """A 1.7M-parameter Qwen3 with the shape the DFlash tests expect."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        dtype="float32",
    )
    return Qwen3ForCausalLM(config)


def training_batches(
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    exclude: set[str],
    batch_size: int,
    group: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Endless (input_ids, attention_mask, labels) batches of fresh examples.

    `group` batches are sampled at once and sorted by length, so each batch
    holds similar lengths and little compute goes to padding. The loss covers
    the assistant tokens and the closing <|im_end|> only.
    """
    pad_id = tokenizer.pad_token_id
    while True:
        rows: list[tuple[list[int], list[int]]] = []
        while len(rows) < batch_size * group:
            ex = sample_example(rng, short=rng.random() < SHORT_FRACTION)
            if ex.prompt in exclude:
                continue
            prompt_ids, full_ids = encode_conversation(tokenizer, ex.prompt, ex.answer)
            full_ids = full_ids[:-1]  # drop the trailing "\n" after <|im_end|>
            labels = [-100] * len(prompt_ids) + full_ids[len(prompt_ids) :]
            rows.append((full_ids, labels))
        rows.sort(key=lambda r: len(r[0]))
        chunks = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = max(len(ids) for ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), pad_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            labels = torch.full((len(chunk), width), -100)
            for row, (ids, lab) in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
                labels[row, : len(lab)] = torch.tensor(lab)
            yield input_ids, mask, labels


def train(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    exclude: set[str],
    steps: int,
    batch_size: int,
    lr: float,
) -> None:
    """AdamW with linear warmup and cosine decay to 10% of the peak rate."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01
    )
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    batches = training_batches(tokenizer, rng, exclude, batch_size, group=8)
    model.train()
    start = time.time()
    running = 0.0
    for step in range(1, steps + 1):
        input_ids, mask, labels = (t.to(model.device) for t in next(batches))
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.item()
        if step % LOG_EVERY == 0 or step == steps:
            print(
                f"  step {step:5d}/{steps}  loss {running / ((step - 1) % LOG_EVERY + 1):.4f}"
                f"  lr {scheduler.get_last_lr()[0]:.2e}  {time.time() - start:6.0f}s",
                flush=True,
            )
            running = 0.0
    model.eval()


# ---------------------------------------------------------------------------
# Generation and data
# ---------------------------------------------------------------------------


@torch.no_grad()
def greedy_responses(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    batch_size: int = 128,
) -> list[str]:
    """Greedy assistant responses, batched with left padding.

    Prompts are processed in length order (similar prompts -> similar response
    lengths, so fewer wasted decode steps) and returned in input order.
    """
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    encoded = [
        tokenizer.apply_chat_template(chat(p), add_generation_prompt=True)["input_ids"]
        for p in prompts
    ]
    order = sorted(range(len(prompts)), key=lambda i: (len(encoded[i]), prompts[i]))
    responses: list[str] = [""] * len(prompts)
    for begin in range(0, len(order), batch_size):
        idx = order[begin : begin + batch_size]
        width = max(len(encoded[i]) for i in idx)
        input_ids = torch.full((len(idx), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            input_ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=im_end,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row, i in enumerate(idx):
            new = out[row, width:].tolist()
            new = new[: new.index(im_end)] if im_end in new else new
            responses[i] = tokenizer.decode(new, skip_special_tokens=True)
    return responses


def exact_match_report(examples: list[Example], responses: list[str]) -> float:
    """Print per-kind exact-match accuracy and return the overall accuracy."""
    hits: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    for ex, response in zip(examples, responses, strict=True):
        totals[ex.kind] += 1
        hits[ex.kind] += response == ex.answer
    for kind in TASKS:
        if totals[kind]:
            print(f"    {kind:12s} {hits[kind]:4d}/{totals[kind]:<4d}")
    return sum(hits.values()) / len(examples)


def write_jsonl(path: Path, prefix: str, examples: list[Example], responses: list[str]) -> None:
    """Write conversations in the ShareGPT-like format the trainer reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for n, (ex, response) in enumerate(zip(examples, responses, strict=True), start=1):
            record = {"id": f"{prefix}-{n:06d}", "conversations": chat(ex.prompt, response)}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def verify_saved_target(tokenizer: PreTrainedTokenizerFast) -> None:
    """Reload the shipped target offline and check it is a usable, non-trivial LM."""
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR)
    loaded = AutoTokenizer.from_pretrained(TARGET_DIR)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert model.config.vocab_size == len(loaded)
    prompts = ["count from 10 to 40", "12 letters down from t"]
    outs = greedy_responses(model, loaded, prompts)
    assert outs[0] != outs[1]
    for out in outs:
        assert len(set(out.split())) > 5, out
        print(f"    reload check: {out[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2800, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    args = parser.parse_args()

    t0 = time.time()
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(SEED)
    rng = random.Random(SEED)

    tokenizer = build_tokenizer()
    print(f"vocab {len(tokenizer)}  mask={tokenizer.mask_token_id}  "
          f"im_end={tokenizer.convert_tokens_to_ids(IM_END)}  eos/pad={tokenizer.eos_token_id}")

    # Held-out prompts first (balanced over kinds); neither the target's
    # training stream nor train.jsonl may contain them.
    heldout: list[Example] = []
    for i, kind in enumerate(TASKS):
        count = NUM_HELDOUT_CONVERSATIONS // len(TASKS)
        count += i < NUM_HELDOUT_CONVERSATIONS % len(TASKS)
        heldout += sample_unique(rng, count, set(), kind)
    heldout_prompts = {e.prompt for e in heldout}
    demo_train = sample_unique(rng, NUM_TRAIN_CONVERSATIONS, heldout_prompts)

    model = build_model(tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    t_train = time.time()
    train(model, tokenizer, rng, heldout_prompts, args.steps, args.batch_size, args.lr)
    train_seconds = time.time() - t_train

    TARGET_DIR.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    model.save_pretrained(TARGET_DIR, safe_serialization=True)
    save_tokenizer(tokenizer, TARGET_DIR)

    print("regenerating demo data with the target (greedy)...")
    t_gen = time.time()
    heldout_responses = greedy_responses(model, tokenizer, [e.prompt for e in heldout])
    train_responses = greedy_responses(model, tokenizer, [e.prompt for e in demo_train])
    gen_seconds = time.time() - t_gen
    all_examples = heldout + demo_train
    all_responses = heldout_responses + train_responses
    for ex, response in zip(all_examples, all_responses, strict=True):
        check_conversation(tokenizer, ex.prompt, response)
    write_jsonl(DATA_DIR / "train.jsonl", "demo", demo_train, train_responses)
    write_jsonl(DATA_DIR / "heldout.jsonl", "heldout", heldout, heldout_responses)
    verify_saved_target(tokenizer)

    print("exact match vs grammar, train.jsonl prompts:")
    train_acc = exact_match_report(demo_train, train_responses)
    print("exact match vs grammar, heldout.jsonl prompts (never trained on):")
    heldout_acc = exact_match_report(heldout, heldout_responses)
    lengths = [len(r.split()) for r in train_responses]
    print(f"train.jsonl exact match {train_acc:.1%}  heldout exact match {heldout_acc:.1%}")
    print(f"mean response length {sum(lengths) / len(lengths):.1f} tokens "
          f"(min {min(lengths)}, max {max(lengths)})")
    print(f"time: train {train_seconds:.0f}s, generate {gen_seconds:.0f}s, "
          f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
