import csv
import json
import logging
import math
import os

import numpy as np
import pytest

from privlm.data.corpora import _resolve_backspaces
from privlm_bench.data import (
    GLUE_TASKS,
    TASK_NAMES,
    Task,
    TextDataset,
    fortune_categories,
    load_fortunes,
    load_glue,
    load_table,
    load_tweets,
    load_wordnet,
    named_task,
    public_corpus,
    split_dataset,
)

needs_wordnet = pytest.mark.skipif(not os.path.isdir("/usr/share/wordnet"), reason="wordnet-base is not installed")
needs_fortunes = pytest.mark.skipif(
    not fortune_categories(), reason="fortunes is not installed (apt-get install fortunes)"
)


def assert_accounted(data: TextDataset) -> None:
    """Every row read is kept, skipped or filtered: nothing disappears without a reason."""
    report = data.report
    assert report["kept"] == len(data)
    assert report["rows_read"] == len(data) + sum(report["skipped"].values()) + sum(report["filtered"].values())
    assert report["label_counts"] == data.label_counts()
    json.dumps(report)  # reports go into benchmark provenance as they are


def toy(labels, *, pairs: bool = False) -> TextDataset:
    labels = np.asarray(labels)
    names = tuple(f"c{i}" for i in range(int(labels.max()) + 1))
    texts = [f"text {i}" for i in range(len(labels))]
    task = Task("toy", "pair" if pairs else "single", names, "auc")
    return TextDataset(task, texts, labels, [f"pair {i}" for i in range(len(labels))] if pairs else None)


# ---------------------------------------------------------------- tweets


def test_tweets_are_tens_of_thousands_of_clean_unique_texts():
    data = load_tweets()
    counts = data.label_counts()
    assert data.task.labels == ("negative", "neutral", "positive") and data.task.metric == "macro_auc"
    assert 20_000 < len(data) < 60_000
    assert all(n > 3_000 for n in counts.values()), counts
    assert len(set(data.texts)) == len(data)
    assert data.report["skipped"]["duplicate text"] > 0
    assert not any("\ufffd" in t or "  " in t or t != t.strip() or not t for t in data.texts)
    assert_accounted(data)


def test_confidence_filter_only_ever_removes_rows():
    sizes = []
    for threshold in (0.0, 0.3, 0.5, 0.7, 0.9, 1.0):
        data = load_tweets(min_confidence=threshold)
        assert_accounted(data)
        sizes.append(len(data))
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] > sizes[2] > sizes[-1] > 0
    assert load_tweets(min_confidence=0.5).report["filtered"]["no confidence in file"] > 0


def test_binary_tweets_have_two_labels_and_no_neutral_rows():
    data = named_task("tweets-binary")
    neutral = set(load_tweets(labels=("neutral", "positive")).texts)
    assert data.task.name == "tweets-binary" and data.task.labels == ("negative", "positive")
    assert data.task.n_classes == 2 and data.task.metric == "auc"
    assert set(np.unique(data.labels)) == {0, 1}
    assert data.report["filtered"]["label not selected"] > 10_000
    positives = {t for t, y in zip(data.texts, data.labels, strict=True) if y == 1}
    assert positives <= neutral and not (set(data.texts) - positives) & neutral


def test_limit_is_a_seeded_stratified_subsample():
    full = load_tweets().label_counts()
    sample = load_tweets(limit=1000, seed=3)
    assert len(sample) == 1000 and sample.report["filtered"]["limit"] == sum(full.values()) - 1000
    for name, n in sample.label_counts().items():
        assert abs(n - 1000 * full[name] / sum(full.values())) <= 1
    assert load_tweets(limit=1000, seed=3).texts == sample.texts
    assert load_tweets(limit=1000, seed=4).texts != sample.texts


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": -5}, "limit"),
        ({"limit": 2.5}, "limit"),
        ({"limit": True}, "limit"),
        ({"seed": -1}, "seed"),
        ({"min_confidence": 1.5}, "min_confidence"),
        ({"min_confidence": math.nan}, "min_confidence"),
        ({"labels": ("negative",)}, "labels"),
        ({"labels": ("negative", "angry")}, "labels"),
        ({"labels": "negative"}, "labels"),
    ],
)
def test_bad_tweet_options_name_the_parameter(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        load_tweets(**kwargs)


# ---------------------------------------------------------------- WordNet


@needs_wordnet
def test_wordnet_examples_are_thousands_of_real_sentences():
    data = load_wordnet()
    assert data.task.name == "wordnet-pos" and data.task.labels == ("noun", "verb", "adj", "adv")
    assert len(data) > 10_000 and min(data.label_counts().values()) > 1_000
    assert np.mean([len(t.split()) for t in data.texts]) > 3
    assert not any('"' in t for t in data.texts)
    adverbs = {t for t, y in zip(data.texts, data.labels, strict=True) if y == 3}
    assert "they performed a cappella" in adverbs
    assert_accounted(data)


@needs_wordnet
def test_wordnet_glosses_are_definitions_without_their_examples():
    data = load_wordnet(part="glosses")
    assert len(data) > 50_000 and data.task.name == "wordnet-glosses-pos"
    assert "without musical accompaniment" in set(data.texts)
    assert "they performed a cappella" not in set(data.texts)
    lexnames = load_wordnet(label="lexname", limit=500)
    assert lexnames.task.n_classes == 45 and "noun.animal" in lexnames.task.labels
    assert_accounted(data)
    assert_accounted(lexnames)


def test_wordnet_parser_on_a_fixture(tmp_path):
    header = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
    lines = {
        "noun": '00000001 05 n 01 dog 0 000 | a domestic animal; barks; "the dog barked"; "a dog\'s life"- Anon;  \n',
        "verb": '00000002 30 v 01 run 0 000 | move fast; "she runs daily"; "she said "hi" fast"  \n',
        "adj": "00000003 00 a 01 red 0 000 | the colour of blood  \n",
        "adv": '00000004 02 r 01 fast 0 000 | quickly; "he ran fast"; "broken example  \n',
    }
    for pos, line in lines.items():
        (tmp_path / f"data.{pos}").write_text(header + line)
    examples = load_wordnet(root=tmp_path)
    assert sorted(examples.texts) == ["a dog's life", "he ran fast", "she runs daily", "the dog barked"]
    assert examples.report["skipped"] == {"malformed example": 1, "unparsed example text": 1}
    assert_accounted(examples)
    glosses = load_wordnet(root=tmp_path, part="glosses", label="lexname")
    by_text = dict(zip(glosses.texts, (glosses.task.labels[y] for y in glosses.labels), strict=True))
    assert by_text == {
        "a domestic animal; barks": "noun.animal",
        "move fast": "verb.change",
        "the colour of blood": "adj.all",
        "quickly": "adv.all",
    }


def test_missing_debian_corpora_say_how_to_install_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base fortunes"):
        load_wordnet(root=tmp_path)
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base fortunes"):
        load_fortunes(root=tmp_path / "absent")


@pytest.mark.parametrize(("kwargs", "parameter"), [({"part": "sentences"}, "part"), ({"label": "sense"}, "label")])
def test_bad_wordnet_options_name_the_parameter(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        load_wordnet(**kwargs)


# ---------------------------------------------------------------- fortunes


@needs_fortunes
def test_fortunes_keep_enough_categories_within_the_length_limit():
    data = load_fortunes(max_chars=300)
    counts = data.label_counts()
    assert data.task.n_classes >= 5 and min(counts.values()) >= 50
    assert {"computers", "science"} <= set(data.task.labels)
    assert max(len(t) for t in data.texts) <= 300
    assert not any(ch in t for t in data.texts for ch in "\b\n\t\x07")
    excluded = data.report["excluded_categories"]
    assert excluded and all(n < 50 for n in excluded.values()) and not set(excluded) & set(data.task.labels)
    assert data.report["filtered"]["longer than max_chars"] > 0
    assert_accounted(data)


@needs_fortunes
def test_fortune_category_selection():
    data = load_fortunes(categories=["science", "computers"], limit=200)
    assert data.task.labels == ("science", "computers") and len(data) == 200
    assert_accounted(data)
    with pytest.raises(ValueError, match="categories"):
        load_fortunes(categories=["science", "no-such-topic"])
    with pytest.raises(ValueError, match="max_chars"):
        load_fortunes(max_chars=0)
    with pytest.raises(ValueError, match="min_per_category"):
        load_fortunes(min_per_category=-1)


def test_fortune_files_are_found_and_parsed(tmp_path):
    (tmp_path / "alpha").write_text("One\n  fortune.\n%\nTwo\n%\n\x07\n%\nThe ___\b\b\bend.\n%\n")
    (tmp_path / "beta").write_text("Three\n%\nOne fortune.\n%\nFour\n")
    (tmp_path / "alpha.dat").write_bytes(b"\x00\x02binary")
    (tmp_path / "alpha.u8").symlink_to("alpha")
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "rude").write_text("x\n%\n")
    assert fortune_categories(tmp_path) == ("alpha", "beta")
    data = load_fortunes(root=tmp_path, min_per_category=1, max_chars=100)
    assert sorted(data.texts) == ["Four", "One fortune.", "The end.", "Three", "Two"]
    assert data.report["skipped"] == {"empty text": 1, "duplicate text": 1}
    assert data.label_counts() == {"alpha": 3, "beta": 2}
    assert_accounted(data)


def test_overstrike_resolves_to_what_a_terminal_shows():
    assert _resolve_backspaces("the ____\b\b\b\bLAST time") == "the LAST time"
    assert _resolve_backspaces("\bplain") == "plain"


# ---------------------------------------------------------------- splits


def test_splits_are_deterministic_disjoint_exhaustive_and_stratified():
    labels = np.repeat([0, 1, 2], [700, 250, 50])
    data = toy(labels)
    splits = split_dataset(data, seed=5, validation=0.2, test=0.1)
    parts = [splits.indices[k] for k in ("train", "validation", "test")]
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(data)))
    for part, expected in zip(parts, (0.7, 0.2, 0.1), strict=True):
        assert np.bincount(labels[part], minlength=3).tolist() == [round(expected * n) for n in (700, 250, 50)]
    assert splits.test.texts == [data.texts[i] for i in splits.indices["test"]]
    assert np.array_equal(splits.test.labels, labels[splits.indices["test"]])
    again = split_dataset(data, seed=5, validation=0.2, test=0.1)
    assert all(np.array_equal(again.indices[k], splits.indices[k]) for k in splits.indices)
    other = split_dataset(data, seed=6, validation=0.2, test=0.1)
    assert not np.array_equal(np.sort(other.indices["test"]), np.sort(splits.indices["test"]))
    assert splits.seed == 5


def test_split_of_real_tweets_keeps_label_proportions():
    data = load_tweets(limit=5000)
    splits = split_dataset(data, seed=0)
    whole = np.bincount(data.labels) / len(data)
    for part in (splits.train, splits.validation, splits.test):
        assert np.abs(np.bincount(part.labels, minlength=3) / len(part) - whole).max() < 0.01
    assert not set(splits.train.texts) & set(splits.test.texts)


def test_unstratified_split_and_pairs():
    data = toy(np.arange(101) % 2, pairs=True)
    splits = split_dataset(data, seed=1, validation=0.0, test=0.25, stratify=False)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (76, 0, 25)
    assert [p.replace("pair", "text") for p in splits.test.text_pairs] == splits.test.texts


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan, math.inf, True, "0.1"])
@pytest.mark.parametrize("parameter", ["validation", "test"])
def test_bad_fractions_name_the_parameter(parameter, bad):
    with pytest.raises(ValueError, match=parameter):
        split_dataset(toy([0, 1] * 10), seed=0, **{parameter: bad})


def test_fractions_must_leave_a_train_part_and_seed_must_be_valid():
    with pytest.raises(ValueError, match="validation \\+ test"):
        split_dataset(toy([0, 1] * 10), seed=0, validation=0.5, test=0.5)
    with pytest.raises(ValueError, match="seed"):
        split_dataset(toy([0, 1] * 10), seed=-1)


def test_nothing_touches_the_global_numpy_rng():
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    split_dataset(load_tweets(limit=300, seed=9), seed=2)
    public_corpus(limit=10, seed=1, sources=["tweets"])
    assert np.array_equal(np.random.get_state()[1], before)


def test_dataset_checks_and_subsets():
    data = toy([0, 1, 1, 0], pairs=True)
    picked = data.subset([3, 1])
    assert picked.texts == ["text 3", "text 1"] and picked.text_pairs == ["pair 3", "pair 1"]
    assert picked.labels.tolist() == [0, 1] and picked.labels.dtype == np.int64
    assert data.subset(np.array([True, False, False, True])).texts == ["text 0", "text 3"]
    with pytest.raises(ValueError, match="indices"):
        data.subset([4])
    with pytest.raises(ValueError, match="labels"):
        TextDataset(data.task, ["a"], np.array([2]), ["b"])
    with pytest.raises(ValueError, match="text_pairs"):
        TextDataset(data.task, ["a"], np.array([0]))
    with pytest.raises(ValueError, match="labels"):
        Task("t", "single", ("only",), "auc")
    with pytest.raises(ValueError, match="kind"):
        Task("t", "triple", ("a", "b"), "auc")


# ---------------------------------------------------------------- user files


ROWS = [
    ("Loved it, really.", 'She said "fine"\tand left', "pos"),
    ("Terrible service", "never again", "neg"),
    ("It was okay", "meh", "neutral"),
    ("Great, great, great", "yes", "pos"),
]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_user_files_round_trip_with_pairs_and_string_labels(tmp_path, fmt):
    path = tmp_path / f"mine.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"a": a, "b": b, "y": y}) + "\n" for a, b, y in ROWS))
    else:
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle, delimiter="," if fmt == "csv" else "\t")
            writer.writerows([("a", "b", "y"), *ROWS])
    data = load_table(path, text_column="a", text_pair_column="b", label_column="y")
    assert data.task == Task("mine", "pair", ("neg", "neutral", "pos"), "macro_auc")
    assert data.texts == [r[0] for r in ROWS] and data.text_pairs == [r[1] for r in ROWS]
    assert [data.task.labels[y] for y in data.labels] == [r[2] for r in ROWS]
    assert data.report["format"] == fmt
    assert_accounted(data)


def test_integer_labels_sort_numerically_and_given_labels_set_the_order(tmp_path):
    path = tmp_path / "ints.jsonl"
    path.write_text("".join(json.dumps({"t": f"row {i}", "y": y}) + "\n" for i, y in enumerate([10, 2, 2, 10, 7])))
    data = load_table(path, text_column="t", label_column="y", name="ints")
    assert data.task.labels == ("2", "7", "10") and data.labels.tolist() == [2, 0, 0, 2, 1]
    chosen = load_table(path, text_column="t", label_column="y", labels=[10, 2])
    assert chosen.task.labels == ("10", "2") and chosen.labels.tolist() == [0, 1, 1, 0]
    assert chosen.report["skipped"] == {"label not in labels": 1}
    assert_accounted(chosen)


def test_empty_cells_and_broken_rows_are_reported_not_silently_dropped(tmp_path, caplog):
    path = tmp_path / "holes.csv"
    path.write_text("text,label\ngood one,a\n,b\n   ,a\nno label,\ntoo,many,fields\nanother,b\n,\n")
    with caplog.at_level(logging.INFO, logger="privlm.data"):
        data = load_table(path, text_column="text", label_column="label")
    assert data.texts == ["good one", "another"]
    assert data.report["rows_read"] == 7
    assert data.report["skipped"] == {"empty text": 3, "empty label": 1, "malformed row": 1}
    assert_accounted(data)
    assert "empty text" in caplog.text and "holes" in caplog.text


def test_missing_columns_list_the_available_ones(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("sentence,label,other\nhello,1\n")
    for kwargs, parameter in [
        ({"text_column": "text", "label_column": "label"}, "text_column"),
        ({"text_column": "sentence", "label_column": "y"}, "label_column"),
        ({"text_column": "sentence", "label_column": "label", "text_pair_column": "s2"}, "text_pair_column"),
    ]:
        with pytest.raises(ValueError, match=parameter) as error:
            load_table(path, **kwargs)
        assert "['sentence', 'label', 'other']" in str(error.value)


def test_table_options_are_validated(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("t,y\na,0\nb,1\n")
    with pytest.raises(ValueError, match="format"):
        load_table(path, text_column="t", label_column="y")
    assert len(load_table(path, text_column="t", label_column="y", format="csv")) == 2
    with pytest.raises(ValueError, match="labels"):
        load_table(path, text_column="t", label_column="y", format="csv", labels=["0", "0"])
    with pytest.raises(ValueError, match="limit"):
        load_table(path, text_column="t", label_column="y", format="csv", limit=0)
    with pytest.raises(FileNotFoundError):
        load_table(tmp_path / "absent.csv", text_column="t", label_column="y")


def test_table_limit_keeps_file_order(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text("t,y\n" + "".join(f"row {i},{i % 4 == 0}\n" for i in range(400)))
    data = load_table(path, text_column="t", label_column="y", limit=40, seed=1)
    positions = [int(t.split()[1]) for t in data.texts]
    assert positions == sorted(positions) and data.label_counts() == {"False": 30, "True": 10}


# ---------------------------------------------------------------- GLUE


GLUE_FIXTURES = {
    "sst2": ("sentence\tlabel\nit 's a \"charming\" film \t1\nflat and dull \t0\n", None),
    "mrpc": (
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        '1\t1\t2\tHe said "yes .\tHe agreed .\n0\t3\t4\tShares fell 5% .\tThe CEO resigned .\n',
        ("He said \"yes .", "He agreed ."),
    ),
    "qqp": (
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        "0\t1\t2\tHow do I learn Python?\tWhat is the best way to learn Python?\t1\n"
        "1\t3\t4\tWhy is the sky blue?\tHow tall is Everest?\t0\n",
        ("How do I learn Python?", "What is the best way to learn Python?"),
    ),
    "rte": (
        "index\tsentence1\tsentence2\tlabel\n0\tA cat sat on the mat.\tAn animal sat.\tentailment\n"
        "1\tIt rained.\tThe ground is dry.\tnot_entailment\n",
        ("A cat sat on the mat.", "An animal sat."),
    ),
    "qnli": (
        "index\tquestion\tsentence\tlabel\n0\tWho wrote Hamlet?\tHamlet was written by Shakespeare.\tentailment\n"
        "1\tWhat is 2+2?\tParis is in France.\tnot_entailment\n",
        ("Who wrote Hamlet?", "Hamlet was written by Shakespeare."),
    ),
    "cola": ("gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n", None),
}
GLUE_EXPECTED = {
    "sst2": (("negative", "positive"), [1, 0], "auc"),
    "mrpc": (("not_equivalent", "equivalent"), [1, 0], "auc"),
    "qqp": (("not_duplicate", "duplicate"), [1, 0], "auc"),
    "rte": (("entailment", "not_entailment"), [0, 1], "auc"),
    "qnli": (("entailment", "not_entailment"), [0, 1], "auc"),
    "cola": (("unacceptable", "acceptable"), [1, 0], "matthews"),
}


@pytest.mark.parametrize("name", GLUE_TASKS)
def test_glue_files_parse(tmp_path, name):
    content, first_pair = GLUE_FIXTURES[name]
    path = tmp_path / "dev.tsv"
    path.write_text(content)
    data = load_glue(name, path)
    labels, ids, metric = GLUE_EXPECTED[name]
    assert (data.task.name, data.task.labels, data.labels.tolist(), data.task.metric) == (name, labels, ids, metric)
    assert data.task.is_pair == (first_pair is not None) and len(data) == 2
    if first_pair:
        assert (data.texts[0], data.text_pairs[0]) == first_pair
    assert "matthews" in data.task.metrics if name == "cola" else data.task.metrics == ("accuracy", "auc")
    assert_accounted(data)


def test_glue_sst2_keeps_literal_quotes_and_refuses_unlabelled_test_files(tmp_path):
    path = tmp_path / "dev.tsv"
    path.write_text(GLUE_FIXTURES["sst2"][0])
    assert load_glue("SST-2", path).texts[0] == 'it \'s a "charming" film'
    test_file = tmp_path / "test.tsv"
    test_file.write_text("index\tsentence\n0\tno label here\n")
    with pytest.raises(ValueError, match="label"):
        load_glue("sst2", test_file)
    with pytest.raises(ValueError, match="name"):
        load_glue("mnli", path)


# ---------------------------------------------------------------- public corpus and named tasks


@pytest.mark.slow
@needs_wordnet
@needs_fortunes
def test_public_corpus_is_a_deduplicated_unlabelled_mix():
    corpus = public_corpus()
    assert len(corpus) > 100_000 and len(set(corpus)) == len(corpus)
    assert all(isinstance(t, str) and t for t in corpus)
    everything = set(corpus)
    assert "they performed a cappella" in everything
    assert set(load_tweets(limit=50).texts) <= everything
    assert set(load_fortunes(limit=50).texts) <= everything
    assert public_corpus(limit=500, seed=1) == public_corpus(limit=500, seed=1)
    assert public_corpus(limit=500, seed=1) != public_corpus(limit=500, seed=2)
    assert len(public_corpus(limit=500)) == 500


def test_public_corpus_sources_and_exclusions():
    tweets = set(load_tweets().texts)
    held_out = load_tweets(limit=100, seed=7).texts
    corpus = public_corpus(sources=["tweets"], exclude=held_out)
    assert set(corpus) == tweets - set(held_out) and len(corpus) == len(tweets) - 100
    with pytest.raises(ValueError, match="sources"):
        public_corpus(sources=["wikipedia"])
    with pytest.raises(ValueError, match="exclude"):
        public_corpus(sources=["tweets"], exclude="one text")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_named_tasks_load(name):
    if name.startswith("wordnet") and not os.path.isdir("/usr/share/wordnet"):
        pytest.skip("wordnet-base is not installed")
    if name == "fortunes" and not fortune_categories():
        pytest.skip("fortunes is not installed")
    data = named_task(name, limit=300, seed=1)
    assert len(data) == 300 and data.task.name == name and data.task.n_classes >= 2
    assert len(np.unique(data.labels)) >= 2


def test_unknown_task_names_list_the_known_ones():
    with pytest.raises(ValueError, match="tweets-binary"):
        named_task("imdb")
