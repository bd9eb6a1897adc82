import re

import pytest
from typer.testing import CliRunner

from privlm.cli import app
from privlm.demo import CHAT_EPSILON, CHAT_FOLLOW_UP, CHAT_MECHANISM, CHAT_PROMPT, inversion_at
from privlm.mechanisms import make_generator

runner = CliRunner()


def test_models_lists_the_packaged_defaults():
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0
    assert "minilm" in result.output and "smollm2" in result.output


DEV_ONLY = ("openai", "pytest", "schemathesis", "sentence_transformers", "hypothesis", "ray")
# Importing a dev-extra package fails as if it were not installed (probes with find_spec still see it).
BLOCKER = f"""
import importlib.abc, importlib.util, sys
class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise ModuleNotFoundError(f"{{module.__name__}} is in privlm's dev extra, not installed by pip install privlm",
                                  name=module.__name__)
class DevExtraBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {DEV_ONLY!r}:
            return importlib.util.spec_from_loader(name, _Refuse(), origin="blocked")
        return None
sys.meta_path.insert(0, DevExtraBlocker())
"""


@pytest.mark.slow
def test_demo_runs_without_anything_from_the_dev_extra(tmp_path, smollm2_lm):
    """``pip install privlm`` then ``privlm demo``: the demo (and the server and gateway it starts) imports
    nothing from the dev extra. A sitecustomize makes those packages unimportable in every process."""
    import os
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import openai"], env=env, capture_output=True, text=True)
    assert "dev extra" in probe.stderr  # the blocker works
    result = subprocess.run([sys.executable, "-m", "privlm.cli", "demo", "--seed", "3"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "NN inversion" in result.stdout and "Cape: a private prompt" in result.stdout
    assert "sent to the chat API" in result.stdout and "spent for this prompt" in result.stdout
    assert "OpenAI-format request -> gateway -> private round trip" in result.stdout
    # The chat step (the bench kit is installed here), two turns: each prompt as released, the answer restored, the
    # spend; the second turn perturbs and charges the new message only (its tokens, of the new message's count).
    assert f"released ({CHAT_MECHANISM};" in result.stdout and "answer (restored locally, " in result.stdout
    spends = re.findall(r"spent: (\S+) (?:=|for) (\d+) perturbed tokens \(of (\d+)\)", result.stdout)
    assert len(spends) == 2, result.stdout[-3000:]
    for spent in spends:
        assert float(spent[0]) > 0 and 0 < int(spent[1]) <= int(spent[2])
        if CHAT_MECHANISM in ("cape-public", "cape-public-fast", "custext+"):  # exactly epsilon per perturbed token
            assert float(spent[0]) == pytest.approx(int(spent[1]) * CHAT_EPSILON)
    tokenizer = smollm2_lm.tokenizer
    assert [int(s[2]) for s in spends] == [len(tokenizer(text, add_special_tokens=False)["input_ids"])
                                           for text in (CHAT_PROMPT, CHAT_FOLLOW_UP)]
    assert "exactly as in turn 1, free (2 texts remembered)" in " ".join(result.stdout.split())
    assert "guarantee: privlm:" in result.stdout  # what the spend means, as the report states it
    assert "SAP: private fine-tuning" in result.stdout and "private prediction for" in result.stdout


@pytest.mark.slow
def test_nearest_neighbour_attack_fails_at_strong_and_succeeds_at_weak_eta(minilm):
    sentence = "The quick brown fox jumps over the lazy dog near the river bank."
    generator = make_generator(11)
    strong = [inversion_at(minilm, sentence, 20.0, generator).success_rate for _ in range(5)]
    weak = inversion_at(minilm, sentence, 400.0, generator)
    assert sum(strong) / len(strong) < 0.2
    assert weak.success_rate == 1.0
    assert weak.cosine_to_clean > 0.3


WITHOUT_PLUGINS = """
import importlib.metadata as metadata
import sys

import privlm.plugins

real = metadata.entry_points
privlm.plugins.entry_points = lambda **kw: () if kw.get("group") == "privlm.commands" else real(**kw)
from privlm.cli import app

sys.argv = ["privlm", *sys.argv[1:]]
app()
"""


@pytest.mark.parametrize("command", [["bench", "snd", "--out", "x"], ["serve-llm", "--port", "1"]])
def test_without_the_bench_kit_its_commands_say_how_to_install_it(command):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", WITHOUT_PLUGINS, *command], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"`privlm {command[0]}` needs the bench kit" in result.stderr
    assert "pip install -e . -e src/privlm_bench" in result.stderr


BROKEN_PLUGIN = """
import sys

import privlm.plugins


def broken():
    raise ImportError("a bench module failed to import")


privlm.plugins.command_plugins = lambda: {"bench": broken}
from privlm.cli import app

sys.argv = ["privlm", *sys.argv[1:]]
app()
"""


def test_a_broken_bench_kit_leaves_the_product_commands_working():
    import subprocess
    import sys

    models = subprocess.run([sys.executable, "-c", BROKEN_PLUGIN, "models"], capture_output=True, text=True,
                            timeout=120)
    assert models.returncode == 0 and "minilm" in models.stdout
    assert "the plugin 'bench' failed to load: ImportError: a bench module failed to import" in models.stderr
    bench = subprocess.run([sys.executable, "-c", BROKEN_PLUGIN, "bench", "snd"], capture_output=True, text=True,
                           timeout=120)
    assert bench.returncode == 1 and "`privlm bench` cannot run: the bench kit failed to load" in bench.stderr
