"""`privlm cape calibrate` and `privlm cape perturb`: what a user runs, on the packaged SmolLM2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from privlm.cli import app

runner = CliRunner()


def test_an_unknown_mechanism_is_refused_before_any_model_loads():
    result = runner.invoke(app, ["cape", "perturb", "hello there", "--mechanism", "rot13"])
    assert result.exit_code == 2
    assert "unknown mechanism 'rot13'" in result.output and "santext" in result.output


def test_cape_without_a_logit_bound_says_how_to_get_one():
    result = runner.invoke(app, ["cape", "perturb", "hello there"])
    assert result.exit_code == 2 and "privlm cape calibrate" in result.output


@pytest.mark.parametrize("epsilon", ["0", "-1", "nan", "inf"])
def test_a_bad_epsilon_is_refused(epsilon):
    result = runner.invoke(app, ["cape", "perturb", "hello there", "--mechanism", "santext", "--epsilon", epsilon])
    assert result.exit_code == 2 and "epsilon" in result.output


@pytest.mark.slow
def test_calibrate_then_perturb_with_its_bound(tmp_path):
    prompts = tmp_path / "public.txt"
    prompts.write_text("What is the capital of France?\n\nWrite a short poem about the sea.\n")
    bound = tmp_path / "bound.json"
    result = runner.invoke(app, ["cape", "calibrate", str(prompts), "--out", str(bound), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    saved = json.loads(bound.read_text())
    assert saved["n_texts"] == 2 and saved["value"] > 0
    args = ["cape", "perturb", "My friend Alice lives in Boston.", "--logit-bound", str(bound), "--seed", "3",
            "--device", "cpu"]
    first, again = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert first.output.strip().splitlines()[-1] == again.output.strip().splitlines()[-1]  # a seed replays it
    assert "non-sensitive" in first.output and "perturbed" in first.output and "privlm" in first.output
    sent = first.output.strip().splitlines()[-1]
    assert sent != "My friend Alice lives in Boston."


@pytest.mark.slow
def test_a_prompt_of_stopwords_only_from_stdin_is_sent_unchanged_and_costs_nothing():
    result = runner.invoke(app, ["cape", "perturb", "-", "--mechanism", "cape-distance", "--device", "cpu"],
                           input="and the\n")  # read from standard input
    assert result.exit_code == 0, result.output
    assert "nothing was spent" in result.output and result.output.strip().splitlines()[-1] == "and the"


def test_calibrate_refuses_an_empty_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    result = runner.invoke(app, ["cape", "calibrate", str(empty)])
    assert result.exit_code == 2 and "no prompt" in result.output
