"""The task corpus: prompts shaped like the lab's lanes, each with the answer a good model gives.

One generator serves two users. `twospeed.builtin.task_model` trains the built-in `demo-task` checkpoint on
it (train seeds), and the lab's task prompts (`prompts: task`, lab/task_prompts.py) draw from it with the
run's own seeds, which the training never saw. So the lab's gates judge a model that has learned these
formats, and a broken quantization or a bad draft model shows in the pass rates.

Every example is `prompt` (the text the lab sends to /v1/completions, or as the user message to
/v1/chat/completions) + `answer` (the completion) + `meta` (what the gates need, and the truth):

agent    SYSTEM block + POLICY filler + TOOLS (JSON schemas), then TURN n EVIDENCE naming a customer's
         request and an id (`#ORD-793148`, `#PO-48048`: each kind of id in several schemes)  ->
         {"tool": T, "arguments": {"id": ID}}: T follows from the request's intent, ID is copied from the
         evidence (a second, closed id is a distractor)
rag      RETRIEVED PASSAGES, each a fact cited with its id (`... [P313].`) and filler, + a QUESTION about one
         subject  ->  two sentences that state the fact and cite the one passage that holds it (the other
         passages are about other subjects)
nightly  mapping rules (the allowed codes listed as the answer writes them) + ROW: id, name, notes  ->
         {"code": C, "confidence": X}: C from the keyword in the notes (UNKNOWN without one), X = 0.9 for two
         keywords, 0.7 for one, 0.3 for none
refusal  SYSTEM: a desk that must never do one thing + USER asks for exactly that  ->  one refusal sentence,
         which ends with the rule word for word
chat     the same SYSTEM block + USER asks for something else  ->  a long templated note (never a refusal)

The lab's lengths arrive as word budgets (`filler_words`, `new_words`): filler is the lab's own word salad,
so a prompt can be made as long as a lane asks without changing what the answer depends on. Everything is
drawn from one `random.Random`, so a seed fixes every byte. The module imports no torch.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# The product domain's words, tools and codes: the corpus's, and the lab's synthetic prompts' (lab/prompts.py)
WORDS = ("account order invoice shipment refund customer warehouse carrier delay status region policy update "
         "report ticket priority escalate review approve reject balance payment credit window schedule route "
         "inventory supplier contract clause renewal discount margin forecast quarter budget audit compliance "
         "incident outage latency deploy rollback service cluster region replica backup restore metric alert "
         "threshold owner team project milestone deadline summary detail evidence source record field value "
         "the a of to and in for with on by from at as is was are be this that it which").split()
TOOLS = ("lookup_order", "issue_refund", "update_address", "escalate_ticket", "search_knowledge_base",
         "schedule_callback", "cancel_subscription", "check_inventory")
CODES = ("RETAIL", "WHOLESALE", "LOGISTICS", "FINANCE", "SUPPORT", "UNKNOWN")

LANES = ("agent", "rag", "nightly", "refusal", "chat")

_FIRST = ("Marla", "Tomas", "Ines", "Kofi", "Priya", "Lena", "Omar", "Greta", "Jun", "Rafael", "Noor", "Elif",
          "Bruno", "Aiko", "Dmitri", "Sara", "Felix", "Amara", "Hugo", "Yara", "Ravi", "Olga", "Mateo", "Zoe")
_LAST = ("Voss", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Haddad", "Kowalski", "Ferreira", "Nakamura",
         "Brandt", "Castillo", "Petrov", "Achebe", "Novak", "Silva", "Larsen", "Romero", "Weber", "Osei", "Quinn")
_SYLLABLES = ("bren", "hal", "vor", "sen", "mar", "kel", "tor", "lin", "dra", "wick", "ost", "ern", "bel", "fay",
              "gard", "hol", "ist", "jun", "kai", "lor", "mun", "nes", "pel", "quin", "rud", "sol", "tam", "vey")
_CITIES = ("Lisbon", "Osaka", "Denver", "Lagos", "Oslo", "Lima", "Pune", "Leeds", "Turin", "Perth", "Quito",
           "Busan", "Tampa", "Cork", "Graz", "Izmir")
_STREETS = ("Elm Street", "Harbor Road", "Mill Lane", "Cedar Avenue", "Station Road", "Park Row", "Bay Street")
_TEAMS = ("Orion", "Atlas", "Juniper", "Falcon", "Cobalt", "Meridian", "Sequoia", "Vega")
_COMPANIES = ("Northwind", "Bluepeak", "Kestrel Foods", "Arcadia Travel", "Helio Energy", "Quarry Labs",
              "Brightline Bank", "Tidewater Retail")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _coined(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _filler(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10 ** n - 1))


@dataclass(slots=True)
class TaskExample:
    lane: str
    prompt: str  # completion text (the lab's /v1/completions prompt; the user message over chat)
    answer: str  # what a good model answers, without the end-of-sequence token
    meta: dict = field(default_factory=dict)  # gate inputs (tools, passage_ids, allowed_codes, expect_refusal) + truth


# -- agent -------------------------------------------------------------------------------------------------
_TOOL_DOCS = {
    "lookup_order": "look up where an order is", "issue_refund": "refund a charge on an order",
    "update_address": "change the delivery address of an order", "escalate_ticket": "hand a ticket to a manager",
    "search_knowledge_base": "find a help article for a ticket", "schedule_callback": "book a phone call back",
    "cancel_subscription": "end a subscription", "check_inventory": "check whether an item is in stock"}
# An id's kind -> the schemes it is written in (prefix, digits): companies number the same thing differently,
# so a tool takes ids of several shapes. The call's one argument is the id, copied from the evidence, where it is
# written "#ORD-793148" so that its tokens are the ones the JSON string holds ('ORD', not ' ORD'): the copy heads
# (builtin/copy_circuit.py) copy the prefix with the digits. With one scheme a tool, task-v16's builds learnt the
# picked tool's prefix as well and wrote it over the copy when they picked the wrong tool (then lost the JSON:
# agent json 92.5-95% on two of four seeds); with several, only the copy predicts it.
_ID_SCHEMES: dict[str, tuple[tuple[str, int], ...]] = {
    "order": (("ORD-", 6), ("PO-", 5), ("SO-", 7)), "ticket": (("T-", 5), ("INC-", 6), ("CASE-", 5)),
    "account": (("ACC-", 5), ("CUST-", 6)), "subscription": (("SUB-", 5), ("PLAN-", 4)),
    "item": (("SKU-", 5), ("ITM-", 6))}
# tool -> (id kind, request templates): {c} customer, {id}, {x} a slot value. A templated note per request used
# to follow the id; which of a tool's notes applied was a second content decision, and builds that missed it
# wrote a frequent note and looped (task-v14: agent json 27.5-90% across seeds).
_INTENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lookup_order": ("order", ("{c} asks where order {id} is; it was due {x} days ago",
                               "{c} wants to know the status of order {id} placed in {city}")),
    "issue_refund": ("order", ("{c} was charged twice for order {id} and wants the money back",
                               "{c} says order {id} arrived broken and asks for a refund of ${x}")),
    "update_address": ("order", ("{c} moved and needs order {id} sent to {x} {street}",
                                 "{c} asks to ship order {id} to {city} instead")),
    "escalate_ticket": ("ticket", ("ticket {id} has been open for {x} days and {c} demands a manager",
                                   "{c} is angry that ticket {id} was closed without a fix")),
    "search_knowledge_base": ("ticket", ("{c} asks in ticket {id} how to reset a {thing}",
                                         "{c} wants a guide for ticket {id} about {thing} setup")),
    "schedule_callback": ("account", ("{c} wants a phone call about account {id} at {x}:00",
                                      "{c} asks to be called back about account {id} on {day}")),
    "cancel_subscription": ("subscription", ("{c} wants to cancel subscription {id} before it renews",
                                             "{c} asks to end subscription {id} because of {reason}")),
    "check_inventory": ("item", ("{c} asks whether item {id} is in stock in {city}",
                                 "{c} needs {x} units of item {id} by friday")),
}
_THINGS = ("router", "password", "printer", "badge", "tablet", "modem", "login", "scanner")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday")
_REASONS = ("the price", "a move abroad", "slow service", "a duplicate plan", "budget cuts")
_DISTRACTORS = ("an earlier ticket {id} was closed last week", "the previous order {id} arrived fine",
                "account {id} was checked yesterday and is fine", "an old note mentions item {id}")
_AGENT_ASK = 'Reply with one JSON tool call {"tool": NAME, "arguments": {...}}:\n'


def agent_prefix(rng: random.Random, filler_words: int, tools: int | None = None) -> str:
    """The byte-stable part: system block, policy filler, the schemas of 3-5 of the tools (drawn, in order)."""
    listed = rng.sample(TOOLS, rng.randint(3, 5) if tools is None else tools)
    schemas = [{"name": t, "description": _TOOL_DOCS[t],
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}, "note": {"type": "string"}},
                               "required": ["id"]}} for t in listed]
    return (f"SYSTEM: You are an operations agent for {rng.choice(_COMPANIES)}. Call exactly one tool per turn.\n"
            f"POLICY: {_filler(rng, filler_words)}\nTOOLS:\n{json.dumps(schemas)}\n")


def _listed_tools(prefix: str) -> list[str]:
    """The tools an agent prefix offers, in its order (all of them when the prefix lists none)."""
    found = sorted((prefix.find(f'{{"name": "{t}"'), t) for t in TOOLS)
    return [t for pos, t in found if pos >= 0] or list(TOOLS)


def _slots(rng: random.Random) -> dict[str, str]:
    return {"x": str(rng.randint(2, 99)), "city": rng.choice(_CITIES), "street": rng.choice(_STREETS),
            "thing": rng.choice(_THINGS), "day": rng.choice(_DAYS), "reason": rng.choice(_REASONS)}


def _new_id(rng: random.Random, kind: str) -> str:
    prefix, digits = rng.choice(_ID_SCHEMES[kind])
    return prefix + _digits(rng, digits)


def agent(rng: random.Random, prefix: str, new_words: int, turn: int = 1) -> TaskExample:
    """A turn whose request is for one of the tools the prefix lists."""
    listed = _listed_tools(prefix)
    tool = rng.choice(listed)
    kind, requests = _INTENTS[tool]
    request = rng.choice(requests)
    ident, slots = _new_id(rng, kind), _slots(rng)
    sentence = request.format(c=_person(rng), id="#" + ident, **slots)
    parts = [sentence + "."]
    if rng.random() < 0.5:
        other = rng.choice(list(_ID_SCHEMES))
        at = rng.randint(0, 1)  # drawn before the distractor: the corpus' bytes follow the order of the draws
        parts.insert(at, rng.choice(_DISTRACTORS).format(id="#" + _new_id(rng, other)) + ".")
    before = rng.randint(0, new_words)
    evidence = " ".join(filter(None, [_filler(rng, before), *parts, _filler(rng, new_words - before)]))
    call = {"tool": tool, "arguments": {"id": ident}}
    return TaskExample("agent", f"{prefix}TURN {turn} EVIDENCE: {evidence}\n{_AGENT_ASK}", json.dumps(call),
                       {"tools": listed, "expected": call})


# -- rag ---------------------------------------------------------------------------------------------------
# noun, statement (with {v}), question, value drawer. The question opens with " The <subject>", as the answer does:
# the answer's subject is then a copy of the question's (the copy heads match the token before, copy_circuit.py),
# not a lookup from the question to the passage that a small model does not learn.
_FACTS: list[tuple[str, str, str, Callable[[random.Random], str]]] = [
    ("contract", "renews on {v}", "The {s}: when does it renew", lambda r: f"20{r.randint(26, 39)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"),
    ("account", "is owned by {v}", "The {s}: who owns it", _person),
    ("invoice", "has a balance of ${v}", "The {s}: what is its balance", lambda r: f"{r.randint(100, 99999):,}"),
    ("shipment", "leaves from {v}", "The {s}: where does it leave from", lambda r: r.choice(_CITIES)),
    ("project", "reports to team {v}", "The {s}: which team does it report to", lambda r: r.choice(_TEAMS)),
    ("cluster", "runs {v} replicas", "The {s}: how many replicas does it run", lambda r: str(r.randint(2, 64))),
    ("warehouse", "is in bay {v}", "The {s}: which bay is it in", lambda r: f"{r.choice('ABCDEFGH')}{r.randint(1, 40)}"),
]
_RAG_ASK = "Answer in two sentences and cite the passage ids you used, like [P012].\nANSWER:"


_PASSAGE = re.compile(r"^The (\S+ (\S+)) (.+?) \[(P\d{3,})\]\.", re.MULTILINE)


def rag_prefix(rng: random.Random, words: int) -> str:
    """RETRIEVED PASSAGES: about `words` words of passages, each opening with one fact about a subject no
    other passage has, cited with the passage's id (`... [P313].`); the rest of a passage is filler."""
    n = max(2, min(40, words // 24))
    ids = [f"P{x:03d}" for x in rng.sample(range(1, 1000), n)]
    per = max(0, words // n - 8)
    subjects: set[str] = set()
    lines = []
    for pid in ids:
        noun, statement, _, value = rng.choice(_FACTS)
        subject = f"{_coined(rng)} {noun}"
        while subject in subjects:
            subject = f"{_coined(rng)} {noun}"
        subjects.add(subject)
        lines.append(f"The {subject} {statement.format(v=value(rng))} [{pid}]. {_filler(rng, rng.randint(0, 2 * per))}")
    return "RETRIEVED PASSAGES:\n" + "\n".join(line.rstrip() for line in lines) + "\n"


def rag(rng: random.Random, prefix: str, new_words: int, turn: int = 1, avoid: frozenset[str] = frozenset()) -> TaskExample:
    """A question about one passage's subject (passages drawn here when `prefix` has none)."""
    if "RETRIEVED PASSAGES:\n" not in prefix:
        prefix += rag_prefix(rng, new_words)
    passages = _PASSAGE.findall(prefix)
    subject, noun, statement, pid = rng.choice([p for p in passages if p[3] not in avoid] or passages)
    question = next(q for n, _, q, _ in _FACTS if n == noun)
    prompt = f"{prefix}QUESTION: {question.format(s=subject)}?\n{_RAG_ASK}"
    answer = f" The {subject} {statement} [{pid}]. No other passage mentions it."
    return TaskExample("rag", prompt, answer, {"passage_ids": sorted(p[3] for p in passages), "expected_id": pid})


# -- nightly -----------------------------------------------------------------------------------------------
_KEYWORDS = {"RETAIL": ("store", "shopper", "checkout", "storefront"),
             "WHOLESALE": ("bulk", "distributor", "pallet", "reseller"),
             "LOGISTICS": ("freight", "carrier", "shipping", "depot"),
             "FINANCE": ("invoice", "payment", "credit", "ledger"),
             "SUPPORT": ("complaint", "helpdesk", "ticket", "outage")}
_FILLER_BAN = {k for words in _KEYWORDS.values() for k in words}
_ROW_WORDS = tuple(w for w in WORDS if w not in _FILLER_BAN)


def nightly_prefix(rng: random.Random, filler_words: int) -> str:
    """The mapping rules. The allowed codes are listed as the answer writes them (`"RETAIL", `), so a first row's
    code is a copy from the list (builtin/task_data.copy_sources), as a later row's is of an earlier answer's; the
    copy heads then put its mass on the codes. (task-v15 listed them bare: a first row's code was copied from
    nowhere, split six ways by the learnt layers, and on 4 of its 8 builds the stop token came first.)"""
    codes = [c for c in CODES if c != "UNKNOWN"]
    rng.shuffle(codes)
    rules = " ".join(f"Rows about {', '.join(_KEYWORDS[c][:-1])} or {_KEYWORDS[c][-1]} are {c}." for c in codes)
    guidance = " ".join(rng.choice(_ROW_WORDS) for _ in range(filler_words))
    return (f"Map each row to a JSON object {{\"code\": CODE, \"confidence\": 0..1}} where CODE is one of "
            f"{', '.join(json.dumps(c) for c in CODES)}, as the rules say. {rules} Anything else is UNKNOWN. "
            f"Guidance: {guidance}\n")


def nightly(rng: random.Random, prefix: str, new_words: int, turn: int = 1) -> TaskExample:
    code = rng.choice(CODES)
    hits = [] if code == "UNKNOWN" else rng.sample(_KEYWORDS[code], rng.choice((1, 2)))
    notes = [rng.choice(_ROW_WORDS) for _ in range(max(2, new_words))]
    for word in hits:
        notes.insert(rng.randint(0, len(notes)), word)
    confidence = {0: 0.3, 1: 0.7, 2: 0.9}[len(hits)]
    row = f"id={_digits(rng, 6)}, name={_coined(rng)} {rng.choice(('Ltd', 'Inc', 'GmbH', 'Co'))}, notes={' '.join(notes)}"
    answer = {"code": code, "confidence": confidence}
    return TaskExample("nightly", f"{prefix}ROW: {row}\nJSON:", " " + json.dumps(answer),
                       {"allowed_codes": list(CODES), "expected": answer})


# -- refusal and chat --------------------------------------------------------------------------------------
# topic -> (what a desk may forbid, requests on that topic, the subject of a note answering one). The topic's own
# word ends the rule (right before its ';') and is in every request on it (and in no other topic's): the
# refuse-or-answer decision is "does the request name the word the rule ends with", which the task model's built
# flag circuit (builtin/flag_circuit.py) reads, not a paraphrase a small model would have to know.
_TOPICS = {
    "pricing": ("discuss internal pricing", ("explain the internal pricing for {x}", "list the pricing tiers for {x}"),
                "the pricing for {x}"),
    "legal": ("give advice on anything legal", ("tell me whether the {x} contract is legal to break",
                                   "explain the legal risk of the {x} deal"), "the {x} contract"),
    "code": ("write code", ("write code that exports the {x} report", "write code for a tool that checks {x}"),
             "a tool for the {x} report"),
    "travel": ("plan travel", ("plan travel to {city} for the {x} team", "book travel to {city} for {x}"),
               "the trip to {city}"),
    "payroll": ("discuss payroll", ("tell me the payroll of the {x} team", "read me the payroll figures for {x}"),
                "the {x} team's payroll"),
    "hiring": ("talk about hiring", ("tell me the hiring plan for the {x} team",
                                           "explain the hiring decision about {x}"), "hiring for the {x} team"),
}
_NOTE_TOPICS = ("the quarterly budget review", "moving the {x} warehouse", "the new carrier contract",
                "the outage at the {x} cluster", "onboarding the {x} team", "the refund backlog",
                "the holiday schedule", "the {x} supplier audit")
# Its first word is its own (no note starts with it): whether to refuse is decided at the first token. After
# ": " it is the rule copied word for word (the five tokens before the topic, ": this desk must never", are the
# rule's too, so the copy heads' five-token match finds the rule, builtin/copy_circuit.py), and its fixed words share
# nothing with a note's ("but I can't" lost to a note's "but <who> will flag" on task-v15's refusal misses).
_RULE = "this desk must never {forbid}"  # the system block's rule, which a refusal ends with word for word
_REFUSAL = f" Sorry, I cannot help: {_RULE}."
REFUSAL_WORD, ANSWER_WORD = "Sorry", "Here"  # the first words of a refusal and of a note
REFUSAL_NEXT, ANSWER_NEXT = ",", " is"  # what follows each (the answer's second token)
ANSWER_CUES = ("\nASSISTANT:", "<|im_start|>assistant\n")  # how a help-desk answer is asked for (completion, chat)


_DESK = "help desk. Policy:"  # what marks a prefix as a help desk's system block


def support_prefix(rng: random.Random, filler_words: int, topic: str | None = None) -> str:
    """A help desk's system block: it forbids one topic (drawn unless given)."""
    forbid = _TOPICS[topic or rng.choice(list(_TOPICS))][0]
    extra = f" {_filler(rng, filler_words)}" if filler_words else ""
    return (f"SYSTEM: You are the assistant of the {rng.choice(_COMPANIES)} {_DESK} {_RULE.format(forbid=forbid)}; "
            f"politely refuse such requests.{extra}\n")


def _forbidden(prefix: str) -> str:
    """The topic a support prefix forbids (its phrase is in the text by construction)."""
    return next(t for t, (forbid, _, _) in _TOPICS.items() if f"{_RULE.format(forbid=forbid)};" in prefix)


def _note(rng: random.Random, subject: str, sentences: int) -> str:
    """A templated multi-paragraph note about `subject`: long, fluent and predictable."""
    # one first word for every note: whether to refuse is decided at the first token, so a note's openers must not
    # split its share of that token three ways (greedy decoding would pick the refusal's one word every time)
    openers = (f"Here is a note about {subject}.", f"Here is what to know about {subject}.",
               f"Here is a short brief on {subject}.")
    body = []
    for i in range(sentences):
        who, city, team = _person(rng), rng.choice(_CITIES), rng.choice(_TEAMS)
        body.append(rng.choice((
            f"First, {who} from team {team} will review {subject} with the {city} office.",
            f"The {city} office expects an update on {subject} by {rng.choice(_DAYS)}.",
            f"Team {team} owns the next step, and {who} is the contact for questions.",
            f"The budget for {subject} stays at ${rng.randint(1, 99)},000 this quarter.",
            f"Risks are low, but {who} will flag any delay to team {team} at once.",
            f"Everyone should read the summary before the {rng.choice(_DAYS)} meeting in {city}.")))
        if i % 4 == 3 and i + 1 < sentences:
            body.append("\n\n")
    closer = f"In short, {subject} is on track, and the next review is on {rng.choice(_DAYS)}."
    return f" {rng.choice(openers)} " + " ".join(body).replace(" \n\n ", "\n\n") + f" {closer}"


def _support(rng: random.Random, prefix: str, request: str, answer: str, refused: bool, lane: str) -> TaskExample:
    return TaskExample(lane, f"{prefix}USER: Please {request}.\nASSISTANT:", answer, {"expect_refusal": refused})


def refusal(rng: random.Random, prefix: str, new_words: int, turn: int = 1) -> TaskExample:
    """A request on exactly the topic the system block forbids (a fresh block when `prefix` has none)."""
    prefix = prefix if _DESK in prefix else prefix + support_prefix(rng, 0)
    topic = _forbidden(prefix)
    request = rng.choice(_TOPICS[topic][1]).format(x=_coined(rng), city=rng.choice(_CITIES))
    return _support(rng, prefix, request, _REFUSAL.format(forbid=_TOPICS[topic][0]), True, "refusal")


def chat(rng: random.Random, prefix: str, new_words: int, turn: int = 1) -> TaskExample:
    """A request the system block allows: a note to draft, or another topic's request; a long note back."""
    prefix = prefix if _DESK in prefix else prefix + support_prefix(rng, 0)
    x, city = _coined(rng), rng.choice(_CITIES)
    if rng.random() < 0.5:
        subject = rng.choice(_NOTE_TOPICS).format(x=x)
        detail = f". Mention {_filler(rng, new_words)}" if new_words > 0 else ""
        request = f"draft a detailed note about {subject}{detail}"
    else:
        topic = rng.choice([t for t in _TOPICS if t != _forbidden(prefix)])
        request = rng.choice(_TOPICS[topic][1]).format(x=x, city=city)
        subject = _TOPICS[topic][2].format(x=x, city=city)
    return _support(rng, prefix, request, _note(rng, subject, rng.randint(4, 10)), False, "chat")


BUILDERS: dict[str, Callable[..., TaskExample]] = {"agent": agent, "rag": rag, "nightly": nightly,
                                                   "refusal": refusal, "chat": chat}


def _skewed(rng: random.Random, lo: int, hi: int) -> int:
    """A length in [lo, hi], mostly short: training pays for every token, and the format is learnt on short ones."""
    return lo + int((hi - lo) * rng.random() ** 2)


def _salt(rng: random.Random) -> str:
    """The lab's first line (`[run SALT]`, lab/schedule.py) on half the examples, so the model expects it."""
    return f"[run {rng.getrandbits(32):08x}]\n" if rng.random() < 0.5 else ""


@dataclass(slots=True)
class TaskSession:
    """Several rounds on one shared prefix (an agent's turns, questions on one set of passages, rows under one
    set of rules, requests to one desk). Every example's prompt is `prefix` + its own part; training puts the
    rounds one after another in one sequence, so the prefix is read once for several answers."""

    prefix: str
    examples: list[TaskExample]


# Most rounds in a training session. A help desk's is one request: a later one would see the earlier one's topic.
# A rag session's is one question: a later answer's " The" would find every earlier question's and answer's.
_ROUNDS = {"agent": 6, "rag": 1, "nightly": 10, "refusal": 1, "chat": 1}


def session(lane: str, rng: random.Random, rounds: int | None = None, length: float = 1.0) -> TaskSession:
    """A training session whose first round is `lane`. Filler lengths are drawn from the training ranges,
    shrunk by `length` (a curriculum starts short: attention finds the one relevant span sooner)."""
    if lane not in BUILDERS:
        raise ValueError(f"task lane must be one of {LANES}, got {lane!r}")
    rounds = rng.randint(1, _ROUNDS[lane]) if rounds is None else rounds
    salt, turn = _salt(rng), rng.randint(1, 30)

    def words(lo: int, hi: int) -> int:
        return _skewed(rng, lo, lo + round((hi - lo) * length))

    if lane == "agent":
        prefix = salt + agent_prefix(rng, words(0, 200))
        return TaskSession(prefix, [agent(rng, prefix, words(0, 160), turn + k) for k in range(rounds)])
    if lane == "rag":
        prefix = salt + rag_prefix(rng, words(40, 600))
        examples: list[TaskExample] = []
        for _ in range(rounds):
            examples.append(rag(rng, prefix, 0, avoid=frozenset(e.meta["expected_id"] for e in examples)))
        return TaskSession(prefix, examples)
    if lane == "nightly":
        prefix = salt + nightly_prefix(rng, words(0, 200))
        return TaskSession(prefix, [nightly(rng, prefix, words(2, 60)) for _ in range(rounds)])
    prefix = salt + support_prefix(rng, words(0, 80))
    kinds = [lane] + [rng.choice(("refusal", "chat", "chat")) for _ in range(rounds - 1)]
    return TaskSession(prefix, [BUILDERS[k](rng, prefix, words(0, 40)) for k in kinds])


def sample(lane: str, rng: random.Random) -> TaskExample:
    """One example of `lane`, lengths from the training ranges (held-out evaluation draws these)."""
    return session(lane, rng, rounds=1).examples[0]
