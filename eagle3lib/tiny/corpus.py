"""Procedurally generated chat dialogues with reasoning: the tiny verifier's training corpus and the shipped prompt set.

Why procedural: a few-million-parameter model trained for minutes on 2 CPU cores cannot learn plain English well enough
to answer chat prompts without looping (measured: 7.3M parameters on stdlib docstrings reached only loss 5.9). Templated
dialogues over a small world (arithmetic worked step by step, unit conversions, list and string tasks, short Python
functions, facts and small talk) are learnable in that budget, so the verifier's answers are structured and its next
token is predictable in the places a drafter can exploit, and unpredictable (numbers, names) where it cannot. That is
the regime real drafters live in.

Every sample is a conversation in the OpenAI message format; assistant turns carry `reasoning_content` (the text inside
<think>) and `content`. A sample is a pure function of (seed, index), so the corpus is reproducible and a held-out
split is just another seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mia", "Noor", "Omar", "Pia"]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "stamps", "shells", "cards"]
ANIMALS = {
    "cat": ("small", "homes", "fish and meat", "purr when they are happy"),
    "dog": ("loyal", "homes", "meat and grains", "bark to warn their family"),
    "horse": ("strong", "farms", "grass and hay", "can sleep while standing"),
    "owl": ("quiet", "forests", "mice and insects", "hunt at night"),
    "whale": ("huge", "oceans", "krill and fish", "sing to each other"),
    "bee": ("busy", "hives", "nectar", "make honey"),
    "frog": ("green", "ponds", "insects", "start life as tadpoles"),
    "camel": ("patient", "deserts", "dry plants", "store fat in their humps"),
}
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Brazil": "Brasilia", "Canada": "Ottawa", "Egypt": "Cairo",
    "India": "New Delhi", "Italy": "Rome", "Mexico": "Mexico City", "Norway": "Oslo", "Peru": "Lima", "Spain": "Madrid",
}
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "banana": "yellow", "coal": "black", "tomato": "red",
          "orange": "orange", "plum": "purple"}
WORDS = ["apple", "river", "planet", "garden", "window", "rocket", "music", "silver", "forest", "pencil", "yellow",
         "castle", "dragon", "lemon", "tiger", "cloud", "bridge", "candle", "mirror", "basket"]
UNITS = [  # (big unit, small unit, factor, quantity word)
    ("km", "m", 1000, "length"), ("m", "cm", 100, "length"), ("kg", "g", 1000, "mass"), ("hours", "minutes", 60, "time"),
    ("minutes", "seconds", 60, "time"), ("liters", "ml", 1000, "volume"), ("days", "hours", 24, "time"),
]
TIPS = {
    "studying": ["take short breaks", "review your notes the next day", "teach the idea to a friend"],
    "sleeping": ["keep a regular bedtime", "avoid screens before bed", "keep the room cool and dark"],
    "cooking": ["read the whole recipe first", "taste as you go", "keep your knives sharp"],
    "running": ["start slowly", "drink enough water", "rest one day each week"],
    "coding": ["write small functions", "test each piece", "read the error message carefully"],
}
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant.", "You are a friendly tutor."]


@dataclass(frozen=True)
class Turn:
    user: str
    reasoning: str
    content: str


def _add(r: random.Random) -> Turn:
    a, b = r.randint(2, 99), r.randint(2, 99)
    q = r.choice([f"What is {a} + {b}?", f"Add {a} and {b}.", f"Compute the sum of {a} and {b}.", f"What do I get if I add {a} to {b}?"])
    return Turn(q, f"The user wants the sum of {a} and {b}. {a} + {b} = {a + b}. So the answer is {a + b}.", f"{a} + {b} = {a + b}.")


def _sub(r: random.Random) -> Turn:
    a = r.randint(10, 99)
    b = r.randint(1, a)
    q = r.choice([f"What is {a} - {b}?", f"Subtract {b} from {a}.", f"What is {a} minus {b}?"])
    return Turn(q, f"I need to take {b} away from {a}. {a} - {b} = {a - b}. So the answer is {a - b}.", f"{a} - {b} = {a - b}.")


def _mul(r: random.Random) -> Turn:
    a, b = r.randint(2, 12), r.randint(2, 12)
    q = r.choice([f"What is {a} x {b}?", f"Multiply {a} by {b}.", f"What is {a} times {b}?"])
    steps = " + ".join([str(a)] * b) if b <= 5 else f"{b} groups of {a}"
    return Turn(q, f"I multiply {a} by {b}. That is {steps}, which is {a * b}. So the answer is {a * b}.", f"{a} x {b} = {a * b}.")


def _story(r: random.Random) -> Turn:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(2, 30), r.randint(2, 30)
    if r.random() < 0.5:
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return Turn(q, f"{name} starts with {a} {item}. Getting {b} more means adding: {a} + {b} = {a + b}.",
                    f"{name} has {a + b} {item} now.")
    a, b = max(a, b), min(a, b)
    q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
    return Turn(q, f"{name} starts with {a} {item}. Giving away {b} means subtracting: {a} - {b} = {a - b}.",
                f"{name} has {a - b} {item} left.")


def _compare(r: random.Random) -> Turn:
    a, b = r.sample(range(1, 100), 2)
    big = max(a, b)
    return Turn(f"Which is larger, {a} or {b}?", f"I compare {a} and {b}. {big} is larger because it is greater than {min(a, b)}.",
                f"{big} is larger.")


def _parity(r: random.Random) -> Turn:
    n = r.randint(1, 200)
    kind = "even" if n % 2 == 0 else "odd"
    return Turn(f"Is {n} even or odd?", f"A number is even if it ends in 0, 2, 4, 6 or 8. {n} ends in {n % 10}, so it is {kind}.",
                f"{n} is {kind}.")


def _units(r: random.Random) -> Turn:
    big, small, factor, _ = r.choice(UNITS)
    n = r.randint(1, 12)
    q = r.choice([f"Convert {n} {big} to {small}.", f"How many {small} are in {n} {big}?"])
    return Turn(q, f"One {big.rstrip('s')} is {factor} {small}. So {n} {big} is {n} x {factor} = {n * factor} {small}.",
                f"{n} {big} is {n * factor} {small}.")


def _fmt(xs: list[int]) -> str:
    return "[" + ", ".join(str(x) for x in xs) + "]"


def _lists(r: random.Random) -> Turn:
    xs = [r.randint(0, 50) for _ in range(r.randint(3, 6))]
    task = r.choice(["sort", "max", "min", "reverse", "length", "sum"])
    if task == "sort":
        s = sorted(xs)
        return Turn(f"Sort the list {_fmt(xs)}.", f"I put the numbers in order from smallest to largest: {', '.join(map(str, s))}.",
                    f"The sorted list is {_fmt(s)}.")
    if task == "max":
        return Turn(f"What is the largest number in {_fmt(xs)}?", f"I look at each number and keep the largest. It is {max(xs)}.",
                    f"The largest number is {max(xs)}.")
    if task == "min":
        return Turn(f"What is the smallest number in {_fmt(xs)}?", f"I look at each number and keep the smallest. It is {min(xs)}.",
                    f"The smallest number is {min(xs)}.")
    if task == "reverse":
        return Turn(f"Reverse the list {_fmt(xs)}.", "I read the list from the end to the start.", f"The reversed list is {_fmt(xs[::-1])}.")
    if task == "length":
        return Turn(f"How many items are in {_fmt(xs)}?", f"I count the items one by one: there are {len(xs)}.",
                    f"The list has {len(xs)} items.")
    return Turn(f"What is the sum of {_fmt(xs)}?", f"I add the numbers: {' + '.join(map(str, xs))} = {sum(xs)}.",
                f"The sum is {sum(xs)}.")


def _strings(r: random.Random) -> Turn:
    w = r.choice(WORDS)
    task = r.choice(["reverse", "upper", "count", "first", "spell"])
    if task == "reverse":
        return Turn(f"Reverse the word '{w}'.", f"I write the letters of {w} from last to first: {' '.join(w[::-1])}.",
                    f"'{w}' reversed is '{w[::-1]}'.")
    if task == "upper":
        return Turn(f"Write '{w}' in capital letters.", f"I change each letter of {w} to upper case.", f"{w.upper()}")
    if task == "count":
        return Turn(f"How many letters are in the word '{w}'?", f"I spell it: {' '.join(w)}. That is {len(w)} letters.",
                    f"'{w}' has {len(w)} letters.")
    if task == "first":
        return Turn(f"What is the first letter of '{w}'?", f"The word {w} starts with {w[0]}.", f"The first letter is '{w[0]}'.")
    return Turn(f"Spell the word '{w}'.", f"I write each letter of {w} with a dash between them.", "-".join(w.upper()))


CODE_TASKS = [  # (request, function body with {a}/{b} argument names, explanation)
    ("adds two numbers", "def {f}({a}, {b}):\n    return {a} + {b}", "The function returns the sum of its two arguments."),
    ("multiplies two numbers", "def {f}({a}, {b}):\n    return {a} * {b}", "The function returns the product of its two arguments."),
    ("returns the largest item of a list", "def {f}({a}):\n    return max({a})", "It uses the built-in max function."),
    ("reverses a string", "def {f}({a}):\n    return {a}[::-1]", "The slice [::-1] walks the string backwards."),
    ("checks if a number is even", "def {f}({a}):\n    return {a} % 2 == 0", "A number is even when the remainder after dividing by 2 is 0."),
    ("squares a number", "def {f}({a}):\n    return {a} * {a}", "The function multiplies the number by itself."),
    ("counts the vowels in a string", "def {f}({a}):\n    return sum(1 for c in {a} if c in 'aeiou')",
     "It counts each character that is a vowel."),
    ("returns the sum of a list", "def {f}({a}):\n    total = 0\n    for x in {a}:\n        total += x\n    return total",
     "The loop adds each item to a running total."),
    ("computes a factorial", "def {f}({a}):\n    result = 1\n    for i in range(2, {a} + 1):\n        result *= i\n    return result",
     "The loop multiplies all numbers from 2 up to the argument."),
    ("returns the length of a list", "def {f}({a}):\n    return len({a})", "It uses the built-in len function."),
]
FUNC_NAMES = ["solve", "compute", "helper", "func", "calc", "process", "run", "do_it"]
ARG_NAMES = [("x", "y"), ("a", "b"), ("n", "m"), ("first", "second"), ("value", "other"), ("items", "extra"), ("s", "t")]


def _code(r: random.Random) -> Turn:
    request, body, why = r.choice(CODE_TASKS)
    f = r.choice(FUNC_NAMES)
    a, b = r.choice(ARG_NAMES)
    code = body.format(f=f, a=a, b=b)
    q = r.choice([f"Write a Python function that {request}.", f"Write a Python function named {f} that {request}.",
                  f"Can you show me Python code that {request}?"])
    return Turn(q, f"I will define a function named {f}. It {request}. I keep it short and simple.",
                f"Here is the function:\n\n```python\n{code}\n```\n\n{why}")


def _greeting(r: random.Random) -> Turn:
    q = r.choice(["Hello!", "Hi there.", "Good morning!", "Hey, how are you?", "Who are you?", "What can you do?"])
    return Turn(q, "The user is greeting me. I should say hello and explain what I can help with.",
                "Hello! I am a small assistant. I can help with math, unit conversions, lists, words and short Python code.")


def _capital(r: random.Random) -> Turn:
    c = r.choice(list(CAPITALS))
    q = r.choice([f"What is the capital of {c}?", f"Tell me the capital city of {c}.", f"Which city is the capital of {c}?"])
    return Turn(q, f"The user asks about {c}. The capital of {c} is {CAPITALS[c]}.", f"The capital of {c} is {CAPITALS[c]}.")


def _color(r: random.Random) -> Turn:
    thing = r.choice(list(COLORS))
    q = r.choice([f"What color is {thing}?", f"What is the color of {thing}?"])
    return Turn(q, f"I think about {thing}. It is usually {COLORS[thing]}.", f"{thing.capitalize()} is usually {COLORS[thing]}.")


def _animal(r: random.Random) -> Turn:
    a = r.choice(list(ANIMALS))
    adj, home, food, fact = ANIMALS[a]
    q = r.choice([f"Tell me about {a}s.", f"What do {a}s eat?", f"Give me a fact about {a}s."])
    return Turn(q, f"The user wants to know about {a}s. {a.capitalize()}s are {adj}, live in {home} and eat {food}.",
                f"{a.capitalize()}s are {adj} animals. They live in {home} and eat {food}. Fun fact: {a}s {fact}.")


def _tip(r: random.Random) -> Turn:
    topic = r.choice(list(TIPS))
    tips = r.sample(TIPS[topic], 2)
    q = r.choice([f"Give me a tip for {topic}.", f"How can I get better at {topic}?"])
    return Turn(q, f"The user wants advice about {topic}. Two good tips are to {tips[0]} and to {tips[1]}.",
                f"Here are two tips for {topic}: first, {tips[0]}. Second, {tips[1]}.")


# Category -> generators. Weights favour math and code because those answers are long and structured.
CATEGORIES: dict[str, list[Callable[[random.Random], Turn]]] = {
    "math": [_add, _sub, _mul, _story, _compare, _parity, _units],
    "code": [_code, _lists, _strings],
    "chat": [_greeting, _capital, _color, _animal, _tip],
}
CATEGORY_WEIGHTS = {"math": 0.45, "code": 0.35, "chat": 0.2}


def sample(seed: int, index: int, *, p_no_think: float = 0.2, p_two_turns: float = 0.15) -> dict:
    """One conversation, a pure function of (seed, index)."""
    r = random.Random(seed * 1_000_003 + index)
    category = r.choices(list(CATEGORY_WEIGHTS), weights=list(CATEGORY_WEIGHTS.values()))[0]
    messages: list[dict] = []
    if r.random() < 0.3:
        messages.append({"role": "system", "content": r.choice(SYSTEM_PROMPTS)})
    think = r.random() >= p_no_think
    for _ in range(2 if r.random() < p_two_turns else 1):
        turn = r.choice(CATEGORIES[category])(r)
        messages.append({"role": "user", "content": turn.user})
        messages.append({"role": "assistant", "content": turn.content, "reasoning_content": turn.reasoning if think else ""})
    return {"id": f"s{seed}-{index}", "category": category, "enable_thinking": think, "messages": messages}


def samples(seed: int, n: int) -> Iterator[dict]:
    for i in range(n):
        yield sample(seed, i)


def prompt_set(seed: int, n: int) -> list[dict]:
    """Prompts (conversation up to the last user turn) for the shipped prompt file, de-duplicated by text."""
    out, seen, i = [], set(), 0
    while len(out) < n:
        s = sample(seed, i)
        i += 1
        msgs = s["messages"][:-1]
        key = tuple(m["content"] for m in msgs)
        if key in seen:
            continue
        seen.add(key)
        # Earlier assistant turns keep their reasoning out of the prompt: the verifier sees content only, as in chat logs.
        msgs = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
        out.append({"id": f"p{len(out):04d}", "category": s["category"], "messages": msgs})
    return out


def write_prompt_files(out_dir, seed: int = 7, n_train: int = 1200, n_heldout: int = 200) -> None:
    """The shipped prompt sets (eagle3lib/assets/prompts/): disjoint by text, so held-out evaluation is honest.

    Regenerate with `python -c "from eagle3lib.tiny.corpus import write_prompt_files; write_prompt_files('eagle3lib/assets/prompts')"`.
    """
    import json
    from pathlib import Path

    prompts = prompt_set(seed, n_train + n_heldout)
    out = Path(out_dir)
    for name, part in (("train.jsonl", prompts[:n_train]), ("heldout.jsonl", prompts[n_train:])):
        with open(out / name, "w") as f:
            for p in part:
                f.write(json.dumps(p) + "\n")


def write_conversations(path, n: int, seed: int, prefix: str = "c"):
    """n whole conversations as a JSONL dataset (ids PREFIX0, PREFIX1, ...): prefill-only input for tests, benchmarks."""
    import json
    from pathlib import Path

    path = Path(path)
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "messages": sample(seed, i)["messages"]}) + "\n"
                            for i in range(n)))
    return path
