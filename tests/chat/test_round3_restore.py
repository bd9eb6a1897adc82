"""Issue 37, item 10: a restored word glued to the word before it ("anddiabetes").

The shape that does it: a token released as one that starts (or ends) with punctuation where the original starts
with a space, such as " diabetes" released as "-related" (a real BPE token shape: "-based", "'s", ".com"). The
upstream saw "asthma and-related" and answers "and-related"; the replacement's hyphen was all that parted it from
"and", so writing back "diabetes" in its place glued the two. The answer's word break is kept: a space where the
replacement's punctuation sat between a word of the answer and the restored word, if the original had a space
there too. A sub-word ("ological" of "immunological", released as ".com") had none: "immun.com" is restored to
"immunological", never split into "immun ological"."""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence

import httpx

from privlm.chat.restore import Restorer, replaced_spans
from privlm.chat.service.completions import Release
from privlm.chat.service.memory import Recalled
from privlm.chat.service.privacy import PrivateTexts
from privlm.mechanisms import PrivacyUnit
from privlm.models.perturbation import PerturbedPrompt, PromptReport, TokenOutcome, TokenRecord
from privlm.settings.chat import ChatOptions
from tests.support.chat import ECHO, ECHO_PREFIX, TIMEOUT, NamePerturber, chat_gateway, fake_privacy

PROMPT = "I have asthma and diabetes."
RELEASED_AS = {" diabetes": "-related"}  # the one token the mechanism changed
ANSWER = "Asthma and-related conditions need care; and -related ones too."

# A sub-word token and a whole word, each released as a token that starts with punctuation.
SUBWORD_PROMPT = "My immunological test and diabetes."
SUBWORD_RELEASED_AS = {"ological": ".com", " diabetes": "-related"}
SUBWORD_SENT = "My immun.com test and-related."


def pieces_of(text: str) -> list[str]:
    """``text`` as a token-level mechanism splits it: a token per word, leading space included, and "immun" /
    "ological" and "pre" / "diabetes" as two tokens each (one word, two sub-words)."""
    pieces = re.findall(r"\s*immun|ological|\s*pre(?=diabetes)|\s*[\w']+|\s*[^\w\s]", text)
    assert "".join(pieces) == text
    return pieces


def report_of(text: str, released_as: dict[str, str]) -> PromptReport:
    """The mechanism's report of ``text``: the tokens of ``released_as`` changed, every other one unchanged."""
    records = tuple(
        TokenRecord(position=i, original=piece, original_id=zlib.crc32(piece.encode()),
                    released=released_as.get(piece, piece),
                    released_id=zlib.crc32(released_as.get(piece, piece).encode()),
                    outcome=TokenOutcome.PERTURBED if piece in released_as else TokenOutcome.NON_SENSITIVE)
        for i, piece in enumerate(pieces_of(text)))
    return PromptReport(mechanism="test", tokens=records, candidate_set_size=2, accounting={"privlm": 1.0},
                        guarantee="a test mechanism")


def release(text: str, released_as: dict[str, str]) -> tuple[str, Restorer]:
    """``text`` through the mechanism: the released text and its restorer, made by the gateway's own
    :meth:`Release.restorer` from the replaced spans and the original."""
    report = report_of(text, released_as)
    released = "".join(record.released for record in report.tokens)
    result = PrivateTexts(texts=[released], reports=[report], mechanism="test", epsilon=1.0,
                          unit=PrivacyUnit.EPSILON, budget_remaining=None)
    recalled = Recalled(result=result, remembered=[False], spans=[replaced_spans(text, report)], new=[])
    return released, Release(recalled=recalled, slots=[], originals=[text], dropped=[]).restorer()


def streamed(restorer: Restorer, answer: str, rng: random.Random) -> str:
    stream, out, at = restorer.stream(), [], 0
    while at < len(answer):
        step = rng.randint(1, 6)
        out.append(stream.feed(answer[at:at + step]))
        at += step
    return "".join(out) + stream.flush()


def assert_restored(restorer: Restorer, answer: str, expected: str) -> None:
    """``answer`` restored to ``expected`` whole, and streamed in 200 different splits."""
    assert restorer.restore(answer)[0] == expected
    rng = random.Random(answer)  # fixed splits: reproducible
    for _ in range(200):
        assert streamed(restorer, answer, rng) == expected


def test_round3_10_a_restored_word_keeps_the_answers_space_before_it_whole_and_streamed():
    released, restorer = release(PROMPT, RELEASED_AS)
    assert released == "I have asthma and-related."
    assert restorer.forward == {"-related": "diabetes"}
    expected = "Asthma and diabetes conditions need care; and diabetes ones too."  # one space each, never two
    assert restorer.restore(ANSWER) == (expected, 2)
    assert_restored(restorer, ANSWER, expected)


def test_round3_10_a_restored_word_keeps_the_answers_space_after_it_whole_and_streamed():
    released, restorer = release("Ask Eva and Tom.", {" Eva": " Inc."})  # a replacement ending with punctuation
    assert released == "Ask Inc. and Tom." and restorer.forward == {"Inc.": "Eva"}
    for answer, expected in [("Maria Inc.and more", "Maria Eva and more"),  # its "." alone parted two words
                             ("Inc., Inc. (Inc.)", "Eva, Eva (Eva)"),  # punctuation or a space beside it: kept
                             ("Inc.", "Eva")]:
        assert_restored(restorer, answer, expected)


def test_round3_10_a_space_is_restored_only_where_the_original_had_one_so_no_sub_word_is_split():
    released, restorer = release(SUBWORD_PROMPT, SUBWORD_RELEASED_AS)
    assert released == SUBWORD_SENT
    assert restorer.forward == {".com": "ological", "-related": "diabetes"}
    assert_restored(restorer, "Your immun.com test and-related care: immun.com.",
                    "Your immunological test and diabetes care: immunological.")
    # One replacement, a whole word once and a sub-word once: no space is added (a word is never split).
    released, restorer = release("I have diabetes, not prediabetes.", {" diabetes": "-related", "diabetes": "-related"})
    assert released == "I have-related, not pre-related." and restorer.forward == {"-related": "diabetes"}
    assert_restored(restorer, "So pre-related.", "So prediabetes.")
    # A plain (released, original) pair, as Restorer.of also takes it, carries no spaces: none is added.
    assert Restorer.of([(".com", "ological")], []).restore("immun.com") == ("immunological", 1)


class SubwordPerturber(NamePerturber):
    """The test mechanism of this file: tokens as :func:`pieces_of` splits them, ``SUBWORD_RELEASED_AS`` released."""

    def perturb_batch(self, texts: Sequence[str]) -> list[PerturbedPrompt]:
        reports = [report_of(text, SUBWORD_RELEASED_AS) for text in texts]
        return [PerturbedPrompt(text="".join(record.released for record in report.tokens), report=report)
                for report in reports]


def test_round3_10_the_gateway_restores_a_sub_word_and_a_spaced_word_as_the_user_wrote_them(stub):
    """Through the gateway (the echo model answers the release): the answer reads as the user's own prompt."""
    with chat_gateway(fake_privacy(SubwordPerturber), stub.url, api_keys=["restore-key"],
                      options=ChatOptions(restore=True)) as url:
        answer = httpx.post(f"{url}/v1/chat/completions", headers={"authorization": "Bearer restore-key"},
                            timeout=TIMEOUT,
                            json={"model": ECHO, "messages": [{"role": "user", "content": SUBWORD_PROMPT}]})
    assert answer.status_code == 200, answer.text
    assert stub.received(SUBWORD_SENT) and not stub.received("immunological")  # the upstream saw the release
    assert answer.json()["choices"][0]["message"]["content"] == ECHO_PREFIX + SUBWORD_PROMPT
    assert answer.headers["x-privlm-restored"] == "2"
