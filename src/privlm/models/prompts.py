"""One prompt as token-level mechanisms see it: token ids, their character spans, and which are sensitive.

Tokenization never adds special tokens and never turns user text into a special token
(``split_special_tokens``): a prompt that contains ``<|im_start|>`` is text like any other.

Non-sensitive tokens (Cape: NLTK's English stopwords and punctuation, shipped as
``privlm/data/non_sensitive_en.txt``) pass through unchanged. A token is non-sensitive when

- its text without the tokenizer's space marker (the offsets of a ``##`` piece never include the marker; a byte-level
  BPE token's span includes its leading space, which is stripped) is in
  the stopword list, exactly or in sentence case ("The", "I"; but "US" is not "us"), and the token
  is a whole word: the characters just before and after it are not word characters (letters,
  digits, apostrophes), so a piece of a longer word ("bos" of "boston", "don" of "don't") is
  sensitive even when its text is a stopword; or
- its text is made only of listed punctuation characters ("," or "!!").

Every other token is sensitive, including tokens the tokenizer could not represent (its unknown
token): those are flagged ``unknown``, perturbed like any sensitive token, and reported. Characters
of the prompt that no token covers (dropped by the tokenizer's normaliser) are reported as
``uncovered`` spans; they are not in the released text.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources

from transformers import PreTrainedTokenizerBase

DEFAULT_NON_SENSITIVE = "non_sensitive_en.txt"
_APOSTROPHES = "'\u2019"


@dataclass(frozen=True)
class NonSensitiveTokens:
    """Stopwords (lower case) and punctuation characters that pass through unchanged."""

    words: frozenset[str]
    punctuation: frozenset[str]

    @classmethod
    def english(cls) -> NonSensitiveTokens:
        """The shipped list: 179 NLTK English stopwords and 32 punctuation characters."""
        return _shipped(DEFAULT_NON_SENSITIVE)

    @classmethod
    def parse(cls, content: str) -> NonSensitiveTokens:
        """Read ``[stopwords]`` and ``[punctuation]`` sections, one entry per line ("# " starts a comment)."""
        sections: dict[str, set[str]] = {"stopwords": set(), "punctuation": set()}
        current: set[str] | None = None
        for number, line in enumerate(content.splitlines(), start=1):
            entry = line.strip()
            if not entry or entry.startswith("# "):
                continue
            if entry.startswith("[") and entry.endswith("]") and len(entry) > 2:
                if entry[1:-1] not in sections:
                    raise ValueError(f"line {number}: unknown section {entry}; expected [stopwords] or [punctuation]")
                current = sections[entry[1:-1]]
            elif current is None:
                raise ValueError(f"line {number}: an entry before any [stopwords] or [punctuation] section")
            else:
                current.add(entry)
        if any(len(p) != 1 for p in sections["punctuation"]):
            raise ValueError("every [punctuation] entry must be one character")
        return cls(words=frozenset(w.lower() for w in sections["stopwords"]),
                   punctuation=frozenset(sections["punctuation"]))

    @property
    def size(self) -> int:
        return len(self.words) + len(self.punctuation)

    def is_non_sensitive(self, core: str, *, whole_word: bool) -> bool:
        """``core``: the token's text without space marker. See the module doc for the rule."""
        if core and all(c in self.punctuation for c in core):
            return True
        if not whole_word or not core:
            return False
        return core in self.words or (core == core.capitalize() and core.lower() in self.words)


@cache
def _shipped(name: str) -> NonSensitiveTokens:
    return NonSensitiveTokens.parse(resources.files("privlm").joinpath("data", name).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class PromptTokens:
    """A prompt's tokens (no special tokens added), with character spans and flags."""

    text: str
    ids: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]  # character offsets of each token in ``text``
    non_sensitive: tuple[bool, ...]
    unknown: tuple[bool, ...]  # the tokenizer's unknown token: the text could not be represented
    uncovered: tuple[tuple[int, int], ...]  # non-blank character runs no token covers

    def __len__(self) -> int:
        return len(self.ids)

    def piece(self, position: int) -> str:
        """The prompt text of one token (its span)."""
        start, end = self.spans[position]
        return self.text[start:end]

    @property
    def sensitive_positions(self) -> list[int]:
        return [i for i, kept in enumerate(self.non_sensitive) if not kept]


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c in _APOSTROPHES


def _core(text: str, start: int, end: int) -> tuple[int, int]:
    """The span without surrounding whitespace (the space marker of byte-level BPE lies in the span)."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, text: str,
                    non_sensitive: NonSensitiveTokens | None = None) -> PromptTokens:
    """Tokenize ``text`` with offsets and flag every token (see the module doc)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("token-level mechanisms need a fast tokenizer (character offsets); "
                         f"{type(tokenizer).__name__} is not one")
    rules = non_sensitive or NonSensitiveTokens.english()
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
    ids = tuple(int(i) for i in encoded["input_ids"])
    spans = tuple((int(s), int(e)) for s, e in encoded["offset_mapping"])
    unk = tokenizer.unk_token_id
    flags, unknown = [], []
    for token_id, (start, end) in zip(ids, spans, strict=True):
        s, e = _core(text, start, end)
        whole = (s == 0 or not _is_word_char(text[s - 1])) and (e == len(text) or not _is_word_char(text[e]))
        is_unknown = unk is not None and token_id == unk
        unknown.append(is_unknown)
        flags.append(not is_unknown and rules.is_non_sensitive(text[s:e], whole_word=whole))
    return PromptTokens(text=text, ids=ids, spans=spans, non_sensitive=tuple(flags), unknown=tuple(unknown),
                        uncovered=_uncovered(text, spans))


def _uncovered(text: str, spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    covered = bytearray(len(text))
    for start, end in spans:
        covered[start:end] = b"\x01" * (end - start)
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(text):
        if covered[i] or text[i].isspace():
            i += 1
            continue
        j = i
        while j < len(text) and not covered[j] and not text[j].isspace():
            j += 1
        runs.append((i, j))
        i = j
    return tuple(runs)
