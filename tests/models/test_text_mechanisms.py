"""The text-mechanism registry: Cape and the baselines register by name, each in its own unit, and price their own
releases."""

from dataclasses import replace

import pytest

import privlm.baselines
import privlm.cape  # noqa: F401 (Cape's variants register by name)
from privlm.accounting import Ledger
from privlm.mechanisms import PrivacyUnit, make_generator
from privlm.models.perturbation import TextPerturber
from privlm.models.text_mechanisms import (
    MechanismContext,
    TextMechanism,
    register_text_mechanism,
    text_mechanism,
    text_mechanism_names,
    text_mechanisms,
)
from tests.models.tiny import tiny_causal_lm

NAMES = ("cape", "cape-distance", "cape-unbucketed", "cape-public", "cape-public-fast", "santext", "santext+",
         "custext", "custext+", "inferdpt", "text2text", "dp-prompt")
METRIC_DP = {"santext", "santext+", "text2text"}  # scale with the embedding distance: charged in eta-tokens


def test_every_mechanism_is_listed_cape_first():
    assert text_mechanism_names() == NAMES
    assert [m.name for m in text_mechanisms()] == list(NAMES)
    assert {m.name: m.unit for m in text_mechanisms()} == {
        name: PrivacyUnit.ETA_TOKEN if name in METRIC_DP else PrivacyUnit.EPSILON for name in NAMES}
    assert [m.name for m in text_mechanisms() if m.needs_logit_bound] == ["cape", "cape-unbucketed", "dp-prompt"]
    assert [m.name for m in text_mechanisms() if m.causal_only] == ["cape-public", "cape-public-fast", "dp-prompt"]
    assert [m.name for m in text_mechanisms() if m.rewrites] == ["dp-prompt"]
    assert [m.name for m in text_mechanisms() if not m.any_pair] == ["santext", "santext+", "custext", "custext+",
                                                                     "text2text"]  # group, rare-only or metric


def test_a_wrong_name_is_refused_with_the_names_to_choose_from():
    with pytest.raises(ValueError, match="unknown mechanism 'nope'; known: " + ", ".join(NAMES).replace("+", "\\+")):
        text_mechanism("nope")
    with pytest.raises(ValueError, match="not one string"):
        text_mechanisms("cape")
    assert text_mechanism("custext-plus") is text_mechanism("custext+")  # a key finds its mechanism


@pytest.mark.parametrize("taken", ["cape", "santext+", "santext-plus"])
def test_a_name_or_key_already_registered_is_refused(taken):
    before = text_mechanism_names()
    with pytest.raises(ValueError, match="already registered"):
        register_text_mechanism(TextMechanism(name=taken, label="again", family="cape", unit=PrivacyUnit.EPSILON,
                                              description="a second cape", factory=text_mechanism("cape").factory))
    assert text_mechanism_names() == before


@pytest.mark.parametrize("kind", ["masked", "causal"])
def test_each_mechanism_builds_reports_its_unit_and_charges_its_own_price(kind, tiny_masked_lm, tmp_path):
    context = MechanismContext(tiny_masked_lm if kind == "masked" else tiny_causal_lm(), logit_bound=10.0)
    for mechanism in text_mechanisms():
        if mechanism.causal_only and kind == "masked":
            with pytest.raises(ValueError, match="causal"):
                mechanism.check_context(context, epsilon=3.0)  # refused before any build
            with pytest.raises(ValueError, match="causal"):
                mechanism.build(context, epsilon=3.0)
            continue
        mechanism.check_context(context, epsilon=3.0)  # what builds passes the check
        ledger = Ledger(tmp_path / f"{mechanism.key}.db", budgets={mechanism.unit: 1e9})
        perturber = mechanism.build(context, epsilon=3.0, generator=make_generator(0), ledger=ledger,
                                    principal="alice")
        assert isinstance(perturber, TextPerturber) and perturber.unit == mechanism.unit
        report = perturber.perturb("Alice flew to Boston with her sister").report
        assert report.mechanism == mechanism.name and report.accounting["privlm"] > 0
        assert ledger.spent("alice", mechanism.unit) == pytest.approx(report.accounting["privlm"]) == report.spent


@pytest.mark.parametrize("name", NAMES)
def test_the_check_refuses_what_the_build_would_refuse_building_nothing(name):
    def never(*_: object) -> TextPerturber:
        raise AssertionError("the check built the mechanism")

    mechanism = replace(text_mechanism(name), factory=never)
    context = MechanismContext(tiny_causal_lm(), logit_bound=10.0)
    mechanism.check_context(context, epsilon=3.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="epsilon"):
            mechanism.check_context(context, epsilon=bad)
    if name == "dp-prompt":
        with pytest.raises(ValueError, match="logit bound B"):
            mechanism.check_context(MechanismContext(tiny_causal_lm()), epsilon=3.0)
    if mechanism.family == "cape" and not mechanism.causal_only:
        with pytest.raises(TypeError, match="logit bound"):
            mechanism.check_context(MechanismContext(tiny_causal_lm(), logit_bound="10"), epsilon=3.0)  # type: ignore[arg-type]


def test_the_cli_help_names_every_registered_mechanism():
    from privlm.cli.cape import MECHANISM_NAMES

    assert tuple(MECHANISM_NAMES.split(", ")) == text_mechanism_names()
