"""``privlm demo``: what privlm does, on the packaged MiniLM and SmolLM2 models.

1. Privatize a sentence's token embeddings with the d_chi mechanism.
2. Run the nearest-neighbour inversion attack on what a server would see, at a strong and a
   weak eta: it fails at the first and succeeds at the second.
3. Cape: one prompt before and after, with its per-token report and what it cost (on SmolLM2).
4. Split-N-Denoise in-process: private sentence embeddings, with and without the shipped denoiser.
5. Split-N-Denoise as a service: ``privlm serve`` and ``privlm gateway`` on localhost, the client
   SDK, and one OpenAI-format request through the gateway.
6. Private chat through the same gateway (printed as step 5: steps 1 and 2 share one heading): a prompt
   with personal details sent with the ``openai`` client (plain httpx where ``openai`` is not installed: the
   demo needs nothing from the dev extra) to ``privlm serve-llm``, a local SmolLM2 chat server from the bench
   kit (without it, this step says how to install it). The gateway perturbs it with :data:`CHAT_MECHANISM` at
   :data:`CHAT_EPSILON`, the best private point of ``privlm bench chat-quality`` (benchmarks/chat-quality), with
   ``--restore`` and conversation memory. Two turns: the step prints each prompt as released, the answer restored
   (the user's words written back where it quotes a replacement) and the spend; the second turn sends the first
   message again as it was released, free, and charges only the new one.
7. SAP (printed as step 6): ``privlm sap vendor`` on localhost; a customer fine-tunes LoRA through it on 48
   tweets for one epoch, keeping texts, labels and the head, then asks for one private prediction.

The three servers (``privlm serve``, ``serve-llm``, ``sap vendor``) start at the beginning, so that they load their
models while steps 1 to 4 run in this process; every one is stopped when the demo ends, however it ends.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from privlm.attacks import undo_clip_scale
from privlm.mechanisms import (
    DChiLaplace,
    clip_with_effective_noise,
    make_generator,
    project_to_vocabulary,
)
from privlm.models import SplitModel
from privlm.models.perturbation import Accounting
from privlm.plugins import BENCH_MISSING, bench_installed
from privlm.service.process import free_port, launch_privlm, stop, wait_healthy

SENTENCE = "Alice Smith was diagnosed with diabetes in Boston last spring."
PROMPT = "My name is Alice Smith, I live in Boston and my doctor says I have diabetes."
CAPE_EPSILON = 6.0  # step 2's Cape
# Public sample prompts for the logit bound: never the prompts being protected.
CALIBRATION_PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
                       "Summarise this report in three sentences.", "How do I bake bread at home?",
                       "Translate 'good morning' into Spanish.", "Explain photosynthesis to a child."]
SND_SENTENCES = ["I absolutely love my new phone, the camera is stunning.",
                 "The delivery was late and the support team never answered.",
                 "Driverless cars will change how cities are planned."]
SND_ETA = 20.0  # the recommended eta (docs/snd.md: the strongest attack reads 1.5% of the tokens)
CHAT_PROMPT = ("I am Maria Gonzalez, 34, from Seattle. My doctor says my asthma is getting worse. "
               "What should I ask her at my next appointment?")
CHAT_FOLLOW_UP = "She also asked whether Seattle's pollen season matters. Does it?"
CHAT_MAX_TOKENS = 48
# Step 5: the best private point of `privlm bench chat-quality` (benchmarks/chat-quality/results.md: under the bar,
# among mechanisms whose epsilon bounds every pair of tokens, the least epsilon of the answers within noise of the
# closest; a test keeps these equal to it).
CHAT_MECHANISM = "cape-public"
CHAT_EPSILON = 8.0  # per perturbed token
SAP_TWEETS, SAP_ETA = 64, 75.0
SAP_QUESTION = "the crew lost my bag and nobody answered"


@dataclass
class InversionRow:
    eta: float
    mean_noise_norm: float
    recovered: list[str]
    success_rate: float
    cosine_to_clean: float


def word_positions(model: SplitModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Mask of the positions that hold text (not [CLS]/[SEP]/padding)."""
    special = torch.tensor(model.require_tokenizer().all_special_ids, device=input_ids.device)
    return ~torch.isin(input_ids, special)


@torch.inference_mode()
def inversion_at(model: SplitModel, sentence: str, eta: float, generator: torch.Generator) -> InversionRow:
    batch = model.tokenize([sentence])
    clean = model.embed_tokens(batch.input_ids)
    noisy = DChiLaplace(eta=eta).sample(clean, generator=generator)
    clipped, _ = clip_with_effective_noise(clean, noisy, max_norm=model.max_embedding_norm)
    guesses = project_to_vocabulary(noisy[0], model.embedding_matrix)
    words = word_positions(model, batch.input_ids[0])
    success = (guesses[words] == batch.input_ids[0][words]).float().mean().item()
    cosine = torch.nn.functional.cosine_similarity(
        model.encode(clipped, batch.attention_mask), model.encode(clean, batch.attention_mask)).item()
    return InversionRow(eta=eta, mean_noise_norm=(noisy - clean)[0].norm(dim=-1).mean().item(),
                        recovered=list(model.require_tokenizer().convert_ids_to_tokens(guesses[words].tolist())),
                        success_rate=success, cosine_to_clean=cosine)


def cape_section(console: Console, generator: torch.Generator) -> None:
    """One prompt before and after Cape on the packaged SmolLM2, with its per-token report."""
    from privlm.cape import Cape

    console.print(f"[bold]2. Cape: a private prompt[/bold]  prompt: {PROMPT!r}")
    with console.status("Loading SmolLM2-135M-Instruct (Cape's device model) and calibrating its logit bound..."):
        cape = Cape("smollm2", epsilon=CAPE_EPSILON, generator=generator)
        bound = cape.calibrate(CALIBRATION_PROMPTS)
    result = cape.perturb(PROMPT)
    report = result.report
    model = cape.device_model
    console.print(f"Device model {model.name} ({model.kind}): |C| = {report.candidate_set_size:,} candidates, "
                  f"logit bound B = {bound.value:.2f} (from {bound.n_texts} public sample prompts), "
                  f"epsilon = {CAPE_EPSILON:g} per sensitive token, N_b = {cape.config.n_buckets} buckets")
    table = Table("pos", "original", "what happened", "sent", "eps'", "K")
    for token in report.tokens:
        perturbed = token.epsilon is not None
        table.add_row(str(token.position), repr(token.original), str(token.outcome), repr(token.released),
                      f"{token.eps_prime:.2f}" if perturbed and token.eps_prime is not None else "-",
                      str(token.non_empty_buckets) if perturbed else "-")
    console.print(table)
    console.print(f"sent to the chat API: {result.text!r}")
    console.print(f"spent for this prompt: {report.accounting[Accounting.PRIVLM]:.1f} (privlm's sound bound: "
                  f"eps + ln N_b + ln |C| per perturbed token, composed over the {report.n_perturbed} perturbed tokens "
                  f"because each one's context holds the others); the paper's accounting (eps + eps' per token) would "
                  f"say {report.accounting[Accounting.PAPER]:.1f}. See docs/cape.md.\n")


@dataclass
class Launched:
    """A localhost service started at the demo's start, so that it loads its model while the in-process steps run."""

    process: subprocess.Popen[bytes]
    url: str

    @classmethod
    def launch(cls, args: list[str]) -> Launched:
        port = free_port()
        return cls(launch_privlm([*args, "--port", str(port)]), f"http://127.0.0.1:{port}")

    def ready(self, timeout: float = 300.0) -> str:
        """Its URL once it answers its health check."""
        wait_healthy(self.process, f"{self.url}/health", timeout=timeout)
        return self.url


def run(console: Console | None = None, *, seed: int | None = None) -> list[InversionRow]:
    console = console or Console()
    with tempfile.TemporaryDirectory(prefix="privlm-demo-") as scratch:
        server = Launched.launch(["serve"])
        llm = Launched.launch(["serve-llm"]) if bench_installed() else None  # the bench kit's local chat upstream
        vendor = Launched.launch(["sap", "vendor", "--store", str(Path(scratch) / "sap"), "--device", "cpu"])
        try:
            return _steps(console, seed, server, llm, vendor, Path(scratch))
        finally:
            stop(*(s.process for s in (server, llm, vendor) if s is not None))


def _steps(console: Console, seed: int | None, server: Launched, llm: Launched | None, vendor: Launched,
           scratch: Path) -> list[InversionRow]:
    generator = make_generator(seed)
    with console.status("Loading the packaged MiniLM (all-MiniLM-L6-v2)..."):
        model = SplitModel.from_pretrained("minilm")
    console.print(f"[bold]Model[/bold] {model}")
    console.print(f"Clip norm C = max row norm of the vocabulary = {model.max_embedding_norm:.4f}\n")

    console.print(f"[bold]1. d_chi privatization of token embeddings[/bold]  sentence: {SENTENCE!r}")
    rows = [inversion_at(model, SENTENCE, eta, generator) for eta in (25.0, 200.0)]
    table = Table("eta", "E||z|| = d/eta", "mean ||z||", "NN inversion", "cos(sentence emb.)", "what the attack reads")
    for row in rows:
        table.add_row(f"{row.eta:g}", f"{model.hidden_size / row.eta:.2f}", f"{row.mean_noise_norm:.2f}",
                      f"{row.success_rate:.0%}", f"{row.cosine_to_clean:.3f}", " ".join(row.recovered))
    console.print(table)
    console.print("Strong privacy (eta = 25): the nearest-neighbour attack recovers almost nothing. "
                  "Weak privacy (eta = 200): it reads the sentence back.\n")

    cape_section(console, generator)
    snd_section(console, model, generator)
    service_section(console, model, generator, server=server, llm=llm)
    sap_section(console, seed, vendor, scratch)
    return rows


def sap_section(console: Console, seed: int | None, vendor: Launched, scratch: Path) -> None:
    """A vendor (`privlm sap vendor`) on localhost; a customer fine-tunes on a few tweets it keeps, with its labels
    and the head at home, then asks for a private prediction."""
    from privlm.data import load_tweets
    from privlm.sap import Client, SapConfig

    console.print(f"\n[bold]6. SAP: private fine-tuning[/bold]: `privlm sap vendor` on {vendor.url} keeps the "
                  "model's top and trains LoRA on it; the customer keeps its tweets, labels and the head")
    tweets = load_tweets(limit=SAP_TWEETS, seed=0)
    train, validation = tweets.subset(range(SAP_TWEETS - 16)), tweets.subset(range(SAP_TWEETS - 16, SAP_TWEETS))
    config = SapConfig(blocks=0, eta=SAP_ETA, head="customer", epochs=1, batch_size=16, noise_seed=seed)
    try:
        with console.status("Starting privlm sap vendor..."):
            url = vendor.ready()
        with console.status("Fine-tuning through the vendor..."), \
                Client(url, config=config, n_classes=3, cache_dir=scratch / "sap-cache") as client:
            report = client.fit(train.texts, train.labels, validation.texts, validation.labels, progress=False)
            probabilities = client.predict([SAP_QUESTION])
    finally:
        stop(vendor.process)
    traffic, account = report.traffic.by_purpose, report.account
    console.print(f"{len(train.texts)} tweets, {report.steps} steps at eta {SAP_ETA:g}: the vendor received "
                  f"{traffic['upload']['bytes_to_vendor'] / 1e6:.1f} MB of privatized token rows once, then "
                  f"{report.traffic.bytes_to_vendor / 1e6 - traffic['upload']['bytes_to_vendor'] / 1e6:.2f} MB of "
                  "example ids, dL/dh and inference rows: no text, token ids or labels as such (the rows can "
                  "still be inverted, and dL/dh still clusters by label: docs/sap.md measures both)")
    console.print(f"spent {account.eta_tokens:.0f} eta-tokens ({account.noised_positions} positions noised, "
                  f"{account.exact_positions} special tokens sent as they are); validation accuracy "
                  f"{report.best.validation_accuracy:.2f} on {len(validation.texts)} tweets (1 epoch: a smoke test, "
                  "`privlm bench sap` measures it); vendor stopped")
    labels = ("negative", "neutral", "positive")
    console.print(f"private prediction for {SAP_QUESTION!r}: "
                  + ", ".join(f"{name} {p:.2f}" for name, p in zip(labels, probabilities[0].tolist(), strict=True)))


def snd_section(console: Console, model: SplitModel, generator: torch.Generator) -> None:
    from privlm.snd import SnDEncoder

    console.print(f"\n[bold]3. Split-N-Denoise at eta = {SND_ETA:g}[/bold] (client: noise + clip + denoise; "
                  "server: the transformer on noisy token embeddings)")
    clean = model.encode_texts(SND_SENTENCES).numpy()
    denoised = SnDEncoder(model, eta=SND_ETA, generator=generator).encode(SND_SENTENCES)
    raw = SnDEncoder(model, eta=SND_ETA, denoiser=None, generator=generator).encode(SND_SENTENCES)
    table = Table("sentence", "cos(server output, clean)", "cos(denoised, clean)")
    for text, c, r, d in zip(SND_SENTENCES, clean, raw, denoised, strict=True):
        table.add_row(text, f"{float(r @ c):.3f}", f"{float(d @ c):.3f}")
    console.print(table)


def service_section(console: Console, model: SplitModel, generator: torch.Generator, *, server: Launched,
                    llm: Launched | None) -> None:
    import httpx

    from privlm.snd import Client

    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    console.print(f"\n[bold]4. SnD as a service[/bold]: `privlm serve` on {server.url}, client SDK, "
                  f"`privlm gateway` on {gateway_url}")
    processes: list[subprocess.Popen[bytes]] = [server.process]
    try:
        with console.status("Starting privlm serve..."):
            server_url = server.ready()
        chat_options: list[str] = []
        if llm is not None:
            # CUSTEXT+ reads no logit bound: no calibration for this gateway.
            chat_options = ["--chat-upstream", llm.url, "--mechanism", CHAT_MECHANISM,
                            "--epsilon", f"{CHAT_EPSILON:g}", "--restore"]
            processes.append(llm.process)
        gateway = launch_privlm(["gateway", "--server", server_url, "--eta", f"{SND_ETA:g}", *chat_options,
                                 "--port", str(gateway_port)])  # it loads while the client SDK runs
        processes.append(gateway)
        with Client(server_url, eta=SND_ETA, generator=generator) as client:
            private = client.privatize(SND_SENTENCES)
            e_n = client.server_encode(private)  # the only thing that crossed: X~ and the mask
            denoised = client.denoise(private, e_n)
            words = word_positions(model, private.batch.input_ids)
            # The attacker knows eta and C, so it undoes the clip's scale before the nearest-neighbour search.
            unclipped = undo_clip_scale(private.noisy, eta=SND_ETA, clip_norm=model.max_embedding_norm,
                                        vocabulary=model.embedding_matrix)
            guesses = project_to_vocabulary(unclipped, model.embedding_matrix)
        clean = model.encode_texts(SND_SENTENCES)
        table = Table("sentence", "cos(server output, clean)", "cos(denoised, clean)",
                      "NN attack on what the server saw")
        for i, text in enumerate(SND_SENTENCES):
            hits = (guesses[i][words[i]] == private.batch.input_ids[i][words[i]]).float().mean().item()
            table.add_row(text, f"{float(e_n[i] @ clean[i]):.3f}", f"{float(denoised[i] @ clean[i]):.3f}",
                          f"{hits:.0%} of tokens")
        console.print(table)
        with console.status("Starting privlm serve-llm (the local chat upstream) and privlm gateway..."):
            if llm is not None:
                llm.ready()
            wait_healthy(gateway, f"{gateway_url}/health", timeout=300)
        response = httpx.post(f"{gateway_url}/v1/embeddings", timeout=60,
                              json={"model": "privlm-snd-minilm", "input": [SND_SENTENCES[0]]})
        response.raise_for_status()
        answer = response.json()
        vector = torch.tensor(answer["data"][0]["embedding"])
        console.print(f"OpenAI-format request -> gateway -> private round trip: {len(vector)}-d embedding, "
                      f"cos to the non-private one {float(vector @ clean[0]):.3f}, "
                      f"{answer['usage']['prompt_tokens']} tokens, eta {response.headers['x-privlm-eta']} per token")
        if llm is not None:
            chat_section(console, gateway_url)
        else:
            console.print(f"\n[bold]5. Private chat[/bold]: skipped: `privlm serve-llm`, its local upstream, "
                          f"{BENCH_MISSING}.")
    finally:
        stop(*processes)
        console.print("Servers and gateway stopped.")


def chat_section(console: Console, gateway_url: str) -> None:
    """Two chat turns through the gateway to serve-llm: each prompt as released, the answer restored, the spend."""
    console.print("\n[bold]5. Private chat[/bold]: the same gateway, `POST /v1/chat/completions`, to `privlm "
                  "serve-llm` (SmolLM2 as a stand-in for OpenAI, vLLM or Ollama), two turns, with --restore")
    messages: list[dict[str, str]] = []
    for turn, prompt in enumerate((CHAT_PROMPT, CHAT_FOLLOW_UP), start=1):
        messages.append({"role": "user", "content": prompt})
        console.print(f"[bold]turn {turn}[/bold] prompt: {prompt!r}")
        with console.status(f"Perturbing the new message with {CHAT_MECHANISM}, then asking the upstream..."):
            answer, headers, client_name = _chat(gateway_url, messages)
        content = answer["choices"][0]["message"]["content"]
        report = answer["privlm"]
        console.print(f"released ({headers['x-privlm-mechanism']}; all serve-llm received of it): "
                      f"{report['texts'][-1]['sent']!r}")
        console.print(f"answer (restored locally, {headers['x-privlm-restored']} replacements written back; client: "
                      f"{client_name}): {content!r}")
        console.print(f"spent: {_spend(headers)}" + (
            f"; the history (turn 1's message and answer) went up again exactly as in turn 1, free "
            f"({headers['x-privlm-texts-remembered']} texts remembered)" if turn > 1 else ""))
        messages.append({"role": "assistant", "content": content})
    if report.get("guarantee"):
        console.print(f"guarantee: {report['guarantee']}")


def _spend(headers: dict[str, str]) -> str:
    spent, epsilon = float(headers["x-privlm-epsilon-spent"]), float(headers["x-privlm-epsilon"])
    perturbed, tokens = int(headers["x-privlm-tokens-perturbed"]), int(headers["x-privlm-tokens"])
    count = f"{perturbed} perturbed tokens (of {tokens})"
    # cape-public spends exactly epsilon per perturbed token; Cape's sound bound has more terms.
    return (f"{spent:g} = {count} x epsilon {epsilon:g}" if abs(spent - perturbed * epsilon) < 1e-6
            else f"{spent:g} for {count} at epsilon {epsilon:g} (privlm's sound bound)")


def _chat(gateway_url: str, messages: list[dict[str, str]]) -> tuple[dict[str, Any], dict[str, str], str]:
    """The chat call (greedy, with the report in the body) with the ``openai`` client where it is installed, else
    plain httpx (the same request)."""
    model = "smollm2-135m-instruct"
    try:
        import openai
    except ImportError:
        import httpx

        response = httpx.post(f"{gateway_url}/v1/chat/completions", timeout=300,
                              json={"model": model, "messages": messages, "max_tokens": CHAT_MAX_TOKENS,
                                    "temperature": 0.0, "privlm": {"report": True}})
        response.raise_for_status()
        return response.json(), dict(response.headers), "httpx (openai is not installed)"
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=CHAT_MAX_TOKENS, temperature=0.0,  # type: ignore[arg-type]
        extra_body={"privlm": {"report": True}})
    return raw.parse().model_dump(), dict(raw.headers), "openai"
