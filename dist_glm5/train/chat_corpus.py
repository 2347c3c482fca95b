"""Chat transcripts and JSON documents for the default model: what a newcomer asks of it through
the API (tool calls, JSON replies), learned from data rather than only forced by a grammar.

Why: a model trained on code alone, held to a tool-call or JSON grammar, fills a free string with
spaces or an integer with zeros until max_tokens (nothing it read ever closed a value). Here every
value closes, every call closes, every assistant turn ends with <eos>:
- chats rendered by the server's own format for a checkpoint without a chat template
  (`dist_glm5.checkpoint.byte_chat.simple_chat`): tools listed in a system turn, a user request,
  the assistant's GLM tool call(s) and <eos>; some go on with the tool's result and a reply that
  quotes it; others ask for a JSON object, a short answer or a piece of code;
- JSON documents (compact, as the grammar writes them, and indented).
Functions, their schemas (free strings, integers, numbers, booleans, arrays, one level of nesting)
and their values are drawn at random; names and string values come from identifiers of the
training code and a list of place and person names. Values a request states and its call repeats
carry a source map, as the needle documents do (corpus.Doc), so the trainer's copy supervision
sees them. `_call_text` writes a call byte for byte as `byte_chat.glm_call` does (a test holds it).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass

from dist_glm5.checkpoint.byte_chat import COMPACT, arg_text, simple_chat

EOS = 257  # the byte tokenizer's <eos>: every assistant turn ends with it
NAMES = (
    "Oslo Paris Lima Kyoto Cairo Quito Dakar Perth Turin Porto Riga Accra Hanoi Bern Delhi Nairobi "
    "Austin Denver Dublin Madrid Seoul Tokyo Vienna Zurich Ada Grace Linus Guido Alan Edsger "
    "Barbara Donald Ken Dennis Margaret Niklaus Frances Leslie John Tim Sofia Omar Priya Chen Lena"
).split()
VERBS = "get set add find list make send read load save check count open close move fetch".split()
# common nouns of APIs and their arguments: tool names and keys are English words as often as code
# identifiers (a newcomer's functions are get_weather(city), not gmtoff_bad(optname))
NOUNS = (
    "weather city user name message text limit unit width height path file item count size color "
    "title email host port mode word key value language note task event date time price order "
    "book song movie place address phone query topic label tag score level page image photo list "
    "amount number age id status type format folder account team project report room day month "
    "year speed volume temperature location country region owner group channel reason comment"
).split()


@dataclass(frozen=True)
class Words:
    """Lowercase identifiers of the training code, most frequent first (names, keys, values)."""

    idents: tuple[str, ...]
    # paths in free strings as `reports/city.txt`, not `/reports/city.txt`: the leading "/" began
    # a tenth of all free values, more than any word or name, so greedy began every value with it
    # (v3's served JSON: `{"speed":"/report.txt","report":"/report.txt",...` to the budget's end)
    relative_paths: bool = False

    @classmethod
    def from_text(cls, text: bytes, n: int = 3000, relative_paths: bool = False) -> Words:
        found = re.findall(
            rb"(?<![A-Za-z0-9_])[a-z][a-z0-9]{2,9}(?![A-Za-z0-9_])", text[:8_000_000]
        )
        top = [w.decode() for w, _ in Counter(found).most_common(n)]
        skip = {"def", "self", "the", "and", "for"}
        hexy = re.compile(r"[ux][0-9a-f]+")  # escapes such as u2502, x89: not names
        words = tuple(w for w in top if w not in skip and not hexy.fullmatch(w))
        return cls(words, relative_paths)

    def word(self, rng: random.Random) -> str:
        """An English noun half the time, an identifier of the code otherwise."""
        return rng.choice(NOUNS) if rng.random() < 0.5 else rng.choice(self.idents)


# ---- random schemas and values -----------------------------------------------------------------
def free_string(rng: random.Random, w: Words) -> str:
    """A short free string: a word, a name, a few words, a path or a sentence-like phrase."""
    u = rng.random()
    if u < 0.3:
        return w.word(rng)
    if u < 0.55:
        return rng.choice(NAMES)
    if u < 0.8:
        return " ".join(w.word(rng) for _ in range(rng.randint(2, 4)))
    if u < 0.9:
        path = "/".join(w.word(rng) for _ in range(rng.randint(1, 3))) + ".txt"
        return path if w.relative_paths else "/" + path
    return f"{rng.choice(NAMES)} {w.word(rng)}"


def rand_int(rng: random.Random, schema: dict) -> int:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if lo is not None and hi is not None:
        return rng.randint(lo, hi)
    return rng.choice(
        [rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 9999), -rng.randint(1, 99)]
    )


def rand_schema(rng: random.Random, w: Words, depth: int = 0) -> dict:
    kinds = ["string"] * 4 + ["integer"] * 3 + ["number", "boolean", "array"]
    kinds += ["object"] if depth == 0 else []
    k = rng.choice(kinds)
    if k == "string":
        if rng.random() < 0.15:
            return {"type": "string", "enum": rng.sample(NAMES, rng.randint(2, 4))}
        return {"type": "string"}
    if k == "integer":
        if rng.random() < 0.3:
            lo = rng.randint(0, 10)
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([9, 99, 999])}
        return {"type": "integer"}
    if k == "array":
        item = rng.choice([{"type": "string"}, {"type": "integer"}])
        return {"type": "array", "items": item}
    if k == "object":
        return object_schema(rng, w, depth + 1, rng.randint(1, 3))
    return {"type": k}


def object_schema(rng: random.Random, w: Words, depth: int, n_props: int) -> dict:
    keys = list(dict.fromkeys(w.word(rng) for _ in range(n_props)))
    props = {key: rand_schema(rng, w, depth) for key in keys}
    required = [key for key in keys if rng.random() < 0.8] or keys[:1]
    return {"type": "object", "properties": props, "required": required}


def rand_value(rng: random.Random, w: Words, schema: dict):
    t = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if t == "string":
        return free_string(rng, w)
    if t == "integer":
        return rand_int(rng, schema)
    if t == "number":
        return round(rng.uniform(-50, 500), rng.choice([1, 2]))
    if t == "boolean":
        return rng.random() < 0.5
    if t == "array":
        return [rand_value(rng, w, schema["items"]) for _ in range(rng.randint(0, 4))]
    props = schema["properties"]
    keys = [k for k in props if k in schema["required"] or rng.random() < 0.5]
    return {k: rand_value(rng, w, props[k]) for k in keys}


def rand_function(rng: random.Random, w: Words) -> dict:
    """An OpenAI tool object with a random name, description and parameters."""
    verb, noun = rng.choice(VERBS), w.word(rng)
    name = rng.choice([f"{verb}_{noun}", noun, f"{noun}_{w.word(rng)}"])
    params = object_schema(rng, w, 0, rng.choice([1, 1, 2, 2, 3, 4]))
    f = {"name": name, "description": f"{verb.capitalize()} the {noun}.", "parameters": params}
    if rng.random() < 0.3:
        del f["description"]
    return {"type": "function", "function": f}


# ---- documents ---------------------------------------------------------------------------------
class ChatDoc:
    """Token ids (utf-8 bytes and <eos>), per id the earlier position it repeats (-1: none), as
    corpus.Doc keeps them for bytes, and whether it is the assistant's (`replying` while its turn
    is written: the trainer weighs those ids up)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.src: list[int] = []
        self.reply: list[bool] = []
        self.replying = False

    def add(self, text: str | bytes, src: int = -1) -> int:
        """Append text (a repeat of the ids at src.. when src >= 0); returns where it starts."""
        b = text.encode() if isinstance(text, str) else text
        at = len(self.ids)
        self.ids += b
        self.src += [src + i if src >= 0 else -1 for i in range(len(b))]
        self.reply += [self.replying] * len(b)
        return at

    def turn(self) -> None:
        """The assistant's turn starts here (after its role tag)."""
        self.add("\n<|assistant|>\n")
        self.replying = True

    def eos(self) -> None:
        """The assistant's turn (and the document) ends."""
        self.ids.append(EOS)
        self.src.append(-1)
        self.reply.append(self.replying)
        self.replying = False


def _pairs_text(rng: random.Random, args: dict) -> list[tuple[str, str]]:
    """The request's wording of each argument: [(text before the value, value text)]."""
    form = rng.choice(["{k} {v}", "{k}={v}", "{k}: {v}", "{k} is {v}", "{k} set to {v}"])
    pre = form.split("{v}")[0]
    return [(pre.format(k=k), arg_text(v)) for k, v in args.items()]


def _plain_request(rng: random.Random, doc: ChatDoc, fn: dict, args: dict) -> dict[str, int]:
    """A request in plain English that states the values without their keys ("What is the
    weather in Oslo?", "Add 3 items.", "Make it 640 by 480."); returns where each value starts."""
    parts = fn["name"].split("_")
    verb, noun = (parts[0], parts[-1]) if len(parts) > 1 else (rng.choice(VERBS), parts[0])
    noun = rng.choice([noun, noun, rng.choice(NOUNS)])
    vals = [(k, arg_text(v)) for k, v in args.items()]
    rng.shuffle(vals)  # the sentence's order need not be the call's
    first_int = (
        vals and isinstance(args[vals[0][0]], int) and not isinstance(args[vals[0][0]], bool)
    )
    u = rng.random()
    counted = first_int and u < 0.3  # "Add 3 items ...": the verb, then the number
    if counted:
        lead = f"{verb.capitalize()} "
    elif u < 0.5:
        lead = rng.choice(
            [f"What is the {noun} ", "Who is ", f"Where is the {noun} ", f"How is the {noun} "]
        )
    else:
        lead = rng.choice(
            [
                f"{verb.capitalize()} the {noun} ",
                f"Can you {verb} the {noun} ",
                f"Please {verb} ",
                f"I need to {verb} the {noun} ",
                f"{verb.capitalize()} it ",
                "Make it ",
                f"Tell {noun} ",
                f"Could you {verb} ",
            ]
        )
    doc.add(lead)
    at: dict[str, int] = {}
    for i, (key, v) in enumerate(vals):
        if i:
            doc.add(rng.choice([" and ", ", ", " by ", " to ", " with ", " "]))
        elif not counted and not lead.startswith(("Who", "Tell", "Make")):
            doc.add(rng.choice(["in ", "for ", "to ", "of ", "at ", "", "with ", "about "]))
        at[key] = doc.add(v)
        if i == 0 and counted:
            doc.add(f" {noun}s")
    doc.add(rng.choice(["?", ".", "!", " please.", "", ", thanks.", " per day."]))
    return at


def _request(rng: random.Random, doc: ChatDoc, fn: dict, args: dict, say_values: bool) -> dict:
    """Append the user's request for a call of fn to doc; returns {key: where its value starts}."""
    if say_values and args and rng.random() < 0.5:
        return _plain_request(rng, doc, fn, args)
    name = fn["name"]
    lead = rng.choice(
        [f"Call {name} with ", f"Use {name}: ", f"Please run {name} for ", f"{name}: ", "Do it: "]
    )
    at: dict[str, int] = {}
    if not say_values or not args:  # the model makes the values up
        parts = name.split("_")
        doc.add(
            rng.choice(
                [
                    f"Call {name}.",
                    f"Use {name} please.",
                    "Go ahead.",
                    f"{parts[0].capitalize()} the {parts[-1]}.",
                    f"Open the {rng.choice(NOUNS)} {parts[-1]}.",
                    f"Can you {rng.choice(VERBS)} my {parts[-1]}?",
                ]
            )
        )
        return at
    doc.add(lead)
    pairs = _pairs_text(rng, args)
    sep = rng.choice([", ", " and ", "; "])
    for i, (key, (pre, v)) in enumerate(zip(args, pairs)):
        doc.add((sep if i else "") + pre)
        at[key] = doc.add(v)
    doc.add(rng.choice([".", "", "!", ". Thanks."]))
    return at


def _call_text(doc: ChatDoc, call: dict, at: dict[str, int]) -> None:
    """The assistant's call, each value stated in the request marked as its repeat."""
    name, args = call["name"], call["arguments"]
    doc.add(f"<tool_call>{name}")
    for k, v in args.items():
        doc.add(f"<arg_key>{k}</arg_key><arg_value>")
        doc.add(arg_text(v), at.get(k, -1))
        doc.add("</arg_value>")
    doc.add("</tool_call>")


def _json_object(doc: ChatDoc, obj: dict, src: dict[str, int] | None = None) -> dict[str, int]:
    """obj as compact JSON, each value marked as a repeat of src[key] where given; returns where
    each value starts."""
    at, src = {}, src or {}
    doc.add("{")
    for i, (k, v) in enumerate(obj.items()):
        doc.add(("," if i else "") + json.dumps(k) + ":")
        at[k] = doc.add(json.dumps(v, separators=COMPACT), src.get(k, -1))
    doc.add("}")
    return at


def tool_chat(rng: random.Random, w: Words, doc: ChatDoc) -> list[dict]:
    """Tools listed, then one to three rounds of a request and the call(s); a round goes on with
    the tool's result and a reply that quotes it; the last ends with <eos>. More rounds put more
    calls in a row than one listing of tools per call would (the listing is most of the bytes).
    Returns the tools listed."""
    tools = [rand_function(rng, w) for _ in range(rng.choice([1] * 6 + [2] * 3 + [3]))]
    names = {t["function"]["name"] for t in tools}
    if len(names) < len(tools):
        tools = tools[:1]
    doc.add(simple_chat([], tools, add_generation_prompt=False))
    rounds = rng.choice([1, 1, 2, 2, 3])
    for r in range(rounds):
        fn = rng.choice(tools)["function"]
        args = rand_value(rng, w, fn["parameters"])
        doc.add(("\n" if r else "") + "<|user|>\n")
        at = _request(rng, doc, fn, args, say_values=rng.random() < 0.8)
        doc.turn()
        if rng.random() < 0.2:  # a few words first, as chat models often do
            doc.add(rng.choice(["Sure.", "OK.", f"Calling {fn['name']}."]))
        _call_text(doc, {"name": fn["name"], "arguments": args}, at)
        if rng.random() < 0.1:  # a second call of the same function
            again = rand_value(rng, w, fn["parameters"])
            _call_text(doc, {"name": fn["name"], "arguments": again}, {})
        last = r == rounds - 1
        if last and rng.random() < 0.6:
            doc.eos()
            return tools
        _observe_and_reply(rng, w, doc)
        if last:
            doc.eos()
            return tools
        doc.replying = False
    return tools


def _observe_and_reply(rng: random.Random, w: Words, doc: ChatDoc) -> None:
    """The tool's result as an observation, then the assistant's reply quoting a value of it."""
    result = {w.word(rng): rand_value(rng, w, {"type": rng.choice(["string", "integer"])})}
    result.update({w.word(rng): rand_value(rng, w, rand_schema(rng, w, 1)) for _ in range(2)})
    doc.add("\n<|observation|>\n")  # the assistant's: it ends its turn with the call
    doc.replying = False
    doc.add("<tool_response>\n")
    res_at = _json_object(doc, result)
    doc.add("\n</tool_response>")
    doc.turn()
    k = next(iter(result))
    v = json.dumps(result[k], separators=COMPACT)
    doc.add(rng.choice([f"The {k} is ", f"{k.capitalize()}: ", "Done, "]))
    doc.add(v, res_at[k])
    doc.add(".")


def json_chat(rng: random.Random, w: Words, doc: ChatDoc) -> None:
    """A request for a JSON object (its keys, sometimes its values, named), the object, <eos>."""
    # short objects mostly: a reply closes within the few dozen tokens a request allows
    schema = object_schema(rng, w, 0, rng.choice([1, 1, 2, 2, 2, 3, 3, 4, 5]))
    obj = rand_value(rng, w, schema)
    keys = ", ".join(obj) or "anything"
    doc.add("<|user|>\n")
    at = {}
    u = rng.random()
    if u < 0.35:
        doc.add(rng.choice([f"Reply in JSON with {keys}.", f"JSON please: {keys}", "Return JSON."]))
    elif u < 0.7:  # plain English that names neither keys nor values
        noun, name = rng.choice(NOUNS), rng.choice(NAMES)
        keys2 = " and ".join(f"a {k}" for k in list(obj)[:2]) or "a name"
        doc.add(
            rng.choice(
                [
                    f"Give me a JSON object describing a {noun}.",
                    f"Return the {noun} as JSON.",
                    f"A JSON object with {keys2}, please.",
                    f"Describe {name} in JSON.",
                    f"List some {noun}s in JSON.",
                    "Reply in JSON.",
                    f"What is {rng.randint(1, 9)} + {rng.randint(1, 9)}? Answer in JSON.",
                    f"A {noun} record as JSON.",
                    f"Make a JSON config for a {noun}.",
                    f"Summarise this in JSON: the {noun} is {w.word(rng)}.",
                    f"Fill in: {keys}",
                    f"JSON for {name}'s {noun}?",
                ]
            )
        )
    else:
        doc.add("Make a JSON object: ")
        for i, (k, v) in enumerate(obj.items()):
            doc.add((", " if i else "") + f"{k} ")
            at[k] = doc.add(json.dumps(v, separators=COMPACT))
    doc.turn()
    _json_object(doc, obj, at)
    doc.eos()


def text_chat(rng: random.Random, w: Words, doc: ChatDoc, code: bytes) -> None:
    """A question and a short answer, or a request for code and a piece of the training code."""
    doc.add("<|user|>\n")
    if rng.random() < 0.5 and code:
        a = code.find(b"\ndef ", rng.randrange(0, max(1, len(code) - 4096)))
        if a < 0:
            a = 0
        b = code.find(b"\n\n", a + 40)
        snippet = code[a + 1 : (b if 0 < b < a + 600 else a + 400)]
        name = snippet.split(b"(")[0][4:].decode("utf-8", "ignore") if snippet else "it"
        doc.add(rng.choice([f"Write {name} in Python.", f"Show me {name}.", "Some code please."]))
        doc.turn()
        doc.add(snippet)
    else:
        x, y = w.word(rng), rng.choice(NAMES)
        doc.add(rng.choice([f"What is {x}?", f"Where is {y}?", f"Say hello to {y}.", "Hi!"]))
        doc.turn()
        doc.add(rng.choice([f"{x.capitalize()} is a name in Python code.", f"Hello, {y}!", "Hi."]))
    doc.eos()


def json_text(rng: random.Random, w: Words, doc: ChatDoc) -> None:
    """A JSON document on its own: compact (as the grammar writes it) or indented."""
    obj = rand_value(rng, w, object_schema(rng, w, 0, rng.randint(1, 6)))
    style = rng.random()
    if style < 0.6:
        doc.add(json.dumps(obj, separators=COMPACT))
    elif style < 0.9:
        doc.add(json.dumps(obj, indent=rng.choice([2, 4])))
    else:
        doc.add(json.dumps(obj))
    doc.add("\n")


KINDS = (("tool", 0.5), ("json_chat", 0.25), ("text", 0.1), ("json", 0.15))


def chat_row(
    rng: random.Random, w: Words, n: int, code: bytes
) -> tuple[list[int], list[int], list[bool]]:
    """(ids, source map, the assistant's ids) of n tokens of packed chats and JSON documents."""
    doc = ChatDoc()
    while len(doc.ids) < n:
        kind = rng.choices([k for k, _ in KINDS], [p for _, p in KINDS])[0]
        if kind == "tool":
            tool_chat(rng, w, doc)
        elif kind == "json_chat":
            json_chat(rng, w, doc)
        elif kind == "text":
            text_chat(rng, w, doc, code)
        else:
            json_text(rng, w, doc)
        doc.add("\n")
    return doc.ids[:n], doc.src[:n], doc.reply[:n]
