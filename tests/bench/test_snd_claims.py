import math

import pytest

from privlm_bench.snd.claims import claims_report, compare, mean_relative_auc_gain


def _row(method: str, eta: float, auc: float, cosine: float = 0.5, task: str = "t") -> dict[str, object]:
    return {"task": task, "method": method, "eta": eta, "auc": auc, "cosine_to_clean": cosine,
            "attack_success": 1.0 if math.isinf(eta) else eta / 100}


ROWS = [
    _row("non-private", math.inf, 0.9),
    _row("snd", 20.0, 0.66), _row("snd", 50.0, 0.88),
    _row("tokembpriv", 20.0, 0.60), _row("tokembpriv", 50.0, 0.80),
    _row("snd-ablation-budget", 20.0, 0.70), _row("snd-ablation-budget", 50.0, 0.80),
    _row("local-only", 20.0, 0.705), _row("local-only", 50.0, 0.70),
    _row("server-side", 20.0, 0.75), _row("server-side", 50.0, 0.70),
]


def test_comparisons_pair_methods_at_equal_eta_and_skip_the_clean_reference():
    comparisons = compare(ROWS, "snd", "tokembpriv")
    assert [(c.eta, c.auc) for c in comparisons] == [(20.0, (0.66, 0.60)), (50.0, (0.88, 0.80))]
    assert mean_relative_auc_gain(comparisons) == pytest.approx((0.06 / 0.60 + 0.08 / 0.80) / 2)
    assert compare(ROWS, "snd", "text2text") == []


def test_report_states_each_claim_and_where_the_server_is_wasted():
    report = claims_report(ROWS)
    assert "SnD vs TokEmbPriv on t: mean relative AUC gain +10.0% over 2 etas; the claim (>= +10%) holds" in report
    # 0.70 vs 0.705 is a tie at eta 20, +0.10 at eta 50: holds, but the server adds nothing at eta 20.
    assert "**the server's e_n adds to the user's own tokens: holds** (1 better, 1 ties, 0 worse of 2" in report
    assert "no better than the local-only model) on: t at eta 20." in report
    assert "**the user-side denoiser beats the server-side one: does not hold** (1 better, 0 ties, 1 worse" in report
    assert "Not measured: `SnD, ablation budget` or `SnD, no clip` is missing" in report


def test_report_opens_with_method_by_eta_tables():
    report = claims_report(ROWS)
    assert "| method | eta 20 | eta 50 | non-private |" in report
    assert "| SnD | 0.660 | 0.880 | 0.900 |" in report  # AUC
    assert "| TokEmbPriv | 0.200 | 0.500 | 1.000 |" in report  # inversion
