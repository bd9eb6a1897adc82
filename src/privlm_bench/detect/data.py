"""The two evaluation sets of ``privlm bench detect``, as prompts with gold spans of :class:`privlm.detect.Kind`.

1. The chat-quality prompts' test split (:data:`privlm_bench.chat.quality_prompts.PROMPTS_FILE`, ``"split":
   "test"``): templates the detector's generator never saw. Their kinds map to ours (:data:`CHAT_KINDS`); a
   ``number`` span is salary, amount, account, card, record, phone or date, so its kind comes from the slot of its
   template it fills (:data:`NUMBER_SLOTS`): the i-th span of a prompt fills the i-th slot of its template.
2. The hand-written set's test part (:data:`HANDWRITTEN_FILE`, :func:`handwritten_part`: three quarters of it, by
   a hash of the id; the other quarter is the detector's development set). A header line ``## <id> <genre>``
   starts each prompt; its text is every line after it up to the next header, trailing blank lines stripped, inner
   newlines kept; a detail is marked ``[[surface|kind]]`` and the text is the markup with each mark replaced by its
   surface.

Anything that cannot be mapped or parsed fails loudly: a silently dropped span would flatter the recall.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from privlm.detect import Kind
from privlm.detect.synthetic import NAME_PART
from privlm_bench.chat.quality_prompts import PROMPTS_FILE, TEMPLATES, QualityPrompt, read_prompts

HANDWRITTEN_FILE = Path("benchmarks/detect/handwritten.txt")  # relative to the repository root
TEST_SPLIT, HANDWRITTEN, SECOND_BATCH = "test-split", "handwritten", "handwritten-batch-2"
SECOND_BATCH_IDS = "hw2-"  # the ids of the batch written after the first batch's test part was scored

CHAT_KINDS: dict[str, Kind] = {
    "name": Kind.PERSON, "place": Kind.LOCATION, "age": Kind.AGE, "condition": Kind.HEALTH,
    "employer": Kind.ORGANIZATION, "occupation": Kind.OCCUPATION,
}
NUMBER_SLOTS: dict[str, Kind] = {  # the slots of the chat-quality templates that a "number" span fills
    "salary": Kind.AMOUNT, "amount": Kind.AMOUNT, "account": Kind.IDENTIFIER, "card": Kind.IDENTIFIER,
    "record": Kind.IDENTIFIER, "phone": Kind.CONTACT, "date": Kind.DATE,
}


@dataclass(frozen=True)
class GoldSpan:
    """A marked personal detail: ``prompt.text[start:end] == text``."""

    start: int
    end: int
    kind: Kind
    text: str


@dataclass(frozen=True)
class GoldPrompt:
    """A prompt and its gold spans (sorted, disjoint, exact, each with a letter or digit); ``genre``: its
    template id (chat-quality) or the genre of its header (hand-written)."""

    id: str
    text: str
    spans: tuple[GoldSpan, ...]
    genre: str

    def __post_init__(self) -> None:
        end = 0
        for span in self.spans:
            if not end <= span.start < span.end <= len(self.text) or self.text[span.start:span.end] != span.text:
                raise ValueError(f"prompt {self.id}: {span} is not an exact, disjoint, sorted span of its text")
            if not any(char.isalnum() for char in span.text):
                raise ValueError(f"prompt {self.id}: span {span.text!r} has no letter or digit to catch")
            end = span.end


@dataclass(frozen=True)
class EvalSet:
    """A named evaluation set and the file it was read from."""

    name: str
    source: str
    prompts: tuple[GoldPrompt, ...]

    def limited(self, limit: int | None) -> EvalSet:
        """The first ``limit`` prompts (all of them with None)."""
        return self if limit is None else EvalSet(self.name, self.source, self.prompts[:limit])

    def span_counts(self) -> dict[str, int]:
        """Gold spans per kind, in :class:`Kind` order, kinds without spans left out."""
        counts = {kind.value: sum(s.kind == kind for p in self.prompts for s in p.spans) for kind in Kind}
        return {kind: n for kind, n in counts.items() if n}


# --------------------------------------------------------------------------------------------- chat-quality
def template_slots(template_id: str) -> list[str]:
    """The slot types of a chat-quality template, in order (``{salary2}`` is a ``salary``)."""
    templates = dict(TEMPLATES)
    if template_id not in templates:
        raise ValueError(f"no chat-quality template {template_id!r}: the prompts file and TEMPLATES disagree")
    return [field.rstrip("0123456789") for _, field, _, _ in string.Formatter().parse(templates[template_id])
            if field is not None]


def chat_quality_kinds(prompt: QualityPrompt) -> list[Kind]:
    """Our kind of each of ``prompt``'s spans; a number span's from the template slot it fills."""
    slots = template_slots(prompt.template)
    if len(slots) != len(prompt.spans):
        raise ValueError(f"template {prompt.template} has {len(slots)} slots, its prompt {len(prompt.spans)} spans: "
                         f"{prompt.text!r}")
    kinds = []
    for slot, span in zip(slots, prompt.spans, strict=True):
        if (span.kind == "number") != (slot in NUMBER_SLOTS):
            raise ValueError(f"template {prompt.template}: slot {slot!r} does not fill the {span.kind} span "
                             f"{span.text!r}")
        kind = NUMBER_SLOTS[slot] if span.kind == "number" else CHAT_KINDS.get(span.kind)
        if kind is None:
            raise ValueError(f"no kind of privlm.detect for the chat-quality kind {span.kind!r}")
        kinds.append(kind)
    return kinds


def _gold(prompts: Sequence[QualityPrompt]) -> list[GoldPrompt]:
    return [GoldPrompt(f"{prompt.template}/{i}", prompt.text,
                       tuple(GoldSpan(s.start, s.end, kind, s.text)
                             for s, kind in zip(prompt.spans, chat_quality_kinds(prompt), strict=True)),
                       prompt.template) for i, prompt in enumerate(prompts)]


def chat_quality_test(path: str | Path = PROMPTS_FILE) -> EvalSet:
    """The test split of the chat-quality prompts, kinds mapped (numbers by their template slot)."""
    prompts = _gold(read_prompts(path)[1])
    if not prompts:
        raise ValueError(f"{path} has no test split")
    return EvalSet(TEST_SPLIT, str(path), tuple(prompts))


def chat_quality_all(path: str | Path = PROMPTS_FILE) -> list[GoldPrompt]:
    """Both splits of the chat-quality prompts, kinds mapped."""
    train, test = read_prompts(path)
    return _gold([*train, *test])


# --------------------------------------------------------------------------------------------- hand-written
HEADER = re.compile(r"## (\S+)[ \t]+(\S.*?)[ \t]*")
MARK = re.compile(r"\[\[([^\[\]|]+)\|([^\[\]|]+)\]\]")


def _kind(name: str, prompt_id: str) -> Kind:
    try:
        return Kind(name)
    except ValueError:
        raise ValueError(f"prompt {prompt_id}: unknown kind {name!r}; known: {', '.join(Kind)}") from None


def unmark(markup: str, prompt_id: str) -> tuple[str, tuple[tuple[int, int, Kind], ...]]:
    """The text of ``[[surface|kind]]`` markup and its spans (start, end, kind) in that text."""
    parts, spans, at, length = [], [], 0, 0
    for mark in MARK.finditer(markup):
        surface, kind = mark.group(1), _kind(mark.group(2).strip(), prompt_id)
        before = markup[at:mark.start()]
        parts += [before, surface]
        length += len(before)
        spans.append((length, length + len(surface), kind))
        length += len(surface)
        at = mark.end()
    text = "".join([*parts, markup[at:]])
    if "[[" in text or "]]" in text:
        raise ValueError(f"prompt {prompt_id}: a malformed mark is left in {text!r}")
    return text, tuple(spans)


def parse_handwritten(content: str, source: str = "<inline>") -> list[GoldPrompt]:
    """The prompts of a hand-written file's content (see the module docstring)."""
    blocks: list[tuple[str, str, list[str]]] = []
    for number, line in enumerate(content.splitlines(), 1):
        header = HEADER.fullmatch(line)
        if header:
            blocks.append((header.group(1), header.group(2), []))
        elif line.startswith("## "):
            raise ValueError(f"{source}:{number}: a header needs an id and a genre: {line!r}")
        elif blocks:
            blocks[-1][2].append(line)
        elif line.strip():
            raise ValueError(f"{source}:{number}: text before the first '## <id> <genre>' header")
    prompts, seen = [], set()
    for prompt_id, genre, lines in blocks:
        if prompt_id in seen:
            raise ValueError(f"{source}: prompt id {prompt_id!r} appears twice")
        seen.add(prompt_id)
        while lines and not lines[-1].strip():
            lines.pop()
        text, spans = unmark("\n".join(lines), prompt_id)
        if not text.strip():
            raise ValueError(f"{source}: prompt {prompt_id!r} has no text")
        prompts.append(GoldPrompt(prompt_id, text, tuple(GoldSpan(s, e, k, text[s:e]) for s, e, k in spans), genre))
    return prompts


def handwritten_part(prompt_id: str) -> str:
    """``dev`` or ``test``: a quarter of the hand-written prompts, by a stable hash of the id, is for looking at
    and choosing (the detector's development); the rest, at least 150, is only ever scored, by this bench."""
    bucket = int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=8).digest(), "big") % 4
    return "dev" if bucket == 0 else "test"


def read_handwritten(path: str | Path = HANDWRITTEN_FILE, part: str = "test") -> EvalSet:
    """The hand-written set's ``part`` (``test``, ``dev`` or ``all``: :func:`handwritten_part`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"the hand-written set {path} is missing")
    if part not in ("test", "dev", "all"):
        raise ValueError(f"part must be test, dev or all, got {part!r}")
    prompts = parse_handwritten(path.read_text(encoding="utf-8"), str(path))
    prompts = [p for p in prompts if part == "all" or handwritten_part(p.id) == part]
    if not prompts:
        raise ValueError(f"{path} holds no prompt in its {part} part")
    return EvalSet(HANDWRITTEN if part == "test" else f"{HANDWRITTEN}-{part}", str(path), tuple(prompts))


def second_batch(handwritten: EvalSet) -> EvalSet:
    """The prompts of ``handwritten`` from its second batch (ids ``hw2-``): written after the first batch's test
    part had been scored, so that no figure of theirs had been seen when the detector was last changed."""
    return EvalSet(SECOND_BATCH, handwritten.source,
                   tuple(p for p in handwritten.prompts if p.id.startswith(SECOND_BATCH_IDS)))


def load_sets(prompts_file: str | Path, handwritten_file: str | Path, limit: int | None = None
              ) -> Sequence[EvalSet]:
    """The chat-quality test split, the hand-written test part, and that part's second batch on its own (where
    it has one), each cut to its first ``limit`` prompts."""
    handwritten = read_handwritten(handwritten_file)
    later = second_batch(handwritten)
    return [chat_quality_test(prompts_file).limited(limit), handwritten.limited(limit),
            *([later.limited(limit)] if later.prompts else [])]


HELD_OUT_FILE = Path("benchmarks/detect/held-out-values.txt")  # relative to the repository root
WORD_KINDS = frozenset({Kind.PERSON, Kind.ORGANIZATION, Kind.LOCATION, Kind.HEALTH, Kind.MEDICATION,
                        Kind.OCCUPATION, Kind.RELIGION, Kind.ETHNICITY, Kind.SEXUALITY, Kind.UNION})


def held_out_values(prompts_file: str | Path = PROMPTS_FILE, handwritten_file: str | Path = HANDWRITTEN_FILE
                    ) -> list[str]:
    """What the tagger's generator must never draw (``privlm detect train --hold-out``): every marked value of
    a kind named by words in both evaluation sets (all of the chat-quality prompts, the whole hand-written set),
    and each part of every name. Numbers are not held out: the generator's ages and amounts are drawn at random."""
    rows = [*chat_quality_all(prompts_file), *read_handwritten(handwritten_file, part="all").prompts]
    values: set[str] = set()
    for prompt in rows:
        for span in prompt.spans:
            if span.kind in WORD_KINDS:
                values.add(" ".join(span.text.split()))
            if span.kind is Kind.PERSON:
                values.update(part for part in NAME_PART.findall(span.text) if len(part) > 1)
    return sorted(values, key=lambda value: (value.casefold(), value))


def write_held_out(path: str | Path = HELD_OUT_FILE) -> None:
    Path(path).write_text("".join(f"{value}\n" for value in held_out_values()), encoding="utf-8")


if __name__ == "__main__":  # python -m privlm_bench.detect.data: rewrite the held-out file after editing a set
    write_held_out()

