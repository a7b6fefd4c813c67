"""scripts/calibrate_auto.py replays `auto`'s stopping signals over logged rounds: what it would have paid and
answered, against the perfect-signal frontier."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "calibrate_auto.py"


@pytest.fixture(scope="module")
def cal():
    spec = importlib.util.spec_from_file_location("calibrate_auto", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _round(ratio, agrees, min_p, kl=None, div=None):
    return {"ratio": ratio, "agrees_full": agrees, "min_p": min_p, "kl": kl, "first_divergence": div,
            "agreed": None if kl is None else True}


ROWS = [  # sample a: sure and right at 10%; b: unsure at 10%, sure and right at 20%; c: sure but wrong at 10%
    {"task": "t", "index": 0, "rounds": [_round(0.1, True, 0.9), _round(0.2, True, 0.95, kl=0.001)]},
    {"task": "t", "index": 1, "rounds": [_round(0.1, False, 0.2), _round(0.2, True, 0.9, kl=0.5, div=2)]},
    {"task": "t", "index": 2, "rounds": [_round(0.1, False, 0.8), _round(0.2, False, 0.4, kl=0.3, div=0)]},
]


def test_confidence_replay_pays_the_rounds_and_falls_back_to_full(cal):
    s = cal.replay_signal(ROWS, (0.1,), min_p=0.85, tol=None)
    # a: accepted at 0.1 (agrees); b, c: not sure -> full prefill after paying 0.1
    assert s["agreement"] == 1.0 and s["fallback"] == pytest.approx(2 / 3)
    assert s["cost"] == pytest.approx((0.1 + 1.1 + 1.1) / 3)
    s = cal.replay_signal(ROWS, (0.1, 0.2), min_p=0.75, tol=None)
    # a at 0.1; c accepted at 0.1 (0.8 >= 0.75) though wrong; b accepted at 0.2
    assert s["agreement"] == pytest.approx(2 / 3) and s["fallback"] == 0
    assert s["cost"] == pytest.approx((0.1 + 0.1 + 0.3) / 3)


def test_kl_signal_only_between_rounds_adjacent_in_the_log(cal):
    s = cal.replay_signal(ROWS, (0.1, 0.2), min_p=None, tol=0.01)
    assert s["fallback"] == pytest.approx(2 / 3) and s["agreement"] == 1.0  # only a converges (kl 0.001)
    assert cal.replay_signal(ROWS, (0.2,), min_p=None, tol=1e9)["fallback"] == 1.0  # nothing to compare with


def test_frontier_rows_feed_the_perfect_signal_frontier(cal):
    from kvstitch.eval.calibrate import perfect_frontier

    pts = perfect_frontier(cal.frontier_rows(ROWS), ["r0.10", "r0.20"])
    # per sample the cheapest agreeing round: a 0.1, b 0.2, c none -> full (1.0): mean 1.3 / 3
    assert pts[0] == (1.0, pytest.approx(3 / 1.3))
    assert pts[-1][0] < 1.0 and pts[-1][1] > pts[0][1]  # giving samples up buys speed


class _Tok:  # logged probes are token ids: here, one id per word
    WORDS = {1: "9201380.", 2: "1.", 3: "42"}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.WORDS[i] for i in ids)


def test_verification_replay_accepts_the_first_round_agreeing_with_the_short_prompt(cal):
    rows = [  # a: 10% says what the short prompt says (and full); b: 10% a list, 20% the value; c: never
        {"task": "t", "index": 0, "n_context": 1000, "full": "9201380.",
         "rounds": [{"ratio": 0.1, "probe": [1], "agrees_full": True}, {"ratio": 0.2, "probe": [1], "agrees_full": True}]},
        {"task": "t", "index": 1, "n_context": 1000, "full": "9201380.",
         "rounds": [{"ratio": 0.1, "probe": [2, 1], "agrees_full": False}, {"ratio": 0.2, "probe": [1], "agrees_full": True}]},
        {"task": "t", "index": 2, "n_context": 1000, "full": "42",
         "rounds": [{"ratio": 0.1, "probe": [2, 3], "agrees_full": False}, {"ratio": 0.2, "probe": [2, 3], "agrees_full": False}]},
    ]
    verify = {("t", 0, 2): {"answer": "9201380.", "n_context": 100}, ("t", 1, 2): {"answer": "9201380.", "n_context": 100},
              ("t", 2, 2): {"answer": "42", "n_context": 100}}
    v = cal.replay_verify(rows, verify, (0.1, 0.2), 2, _Tok())
    # a stops at 0.1 (0.1 + 0.1 short prompt); b at 0.2 (0.1 + 0.1 + 0.2); c falls back (0.1 + 0.3 + 1)
    assert v["agreement"] == 1.0 and v["fallback"] == pytest.approx(1 / 3)
    assert v["cost"] == pytest.approx((0.2 + 0.4 + 1.4) / 3)
    wrong = {**verify, ("t", 2, 2): {"answer": "1. 42", "n_context": 100}}  # the short prompt shares c's bias
    v = cal.replay_verify(rows, wrong, (0.1,), 2, _Tok())
    assert v["agreement"] == pytest.approx(2 / 3) and v["fallback"] == pytest.approx(1 / 3)  # b falls back, c wrong
    lines = cal.verify_section([{**r, "method": "m"} for r in rows],
                               [{"task": t, "index": i, "m": m, **x} for (t, i, m), x in verify.items()], "m", _Tok())
    assert any(line.startswith("| 2 | 0.1/0.2 | 1.00 |") for line in lines)


def test_plausibility_replay_accepts_a_round_whose_first_tokens_the_short_prompt_finds_likely(cal):
    """`verify_p`: the first round whose probe's first n tokens all have probability >= p under the short prompt
    is accepted (tokens past n do not count), else full prefill; the short prompt's context is paid either way."""
    rows = [{"task": "t", "index": i, "method": "m", "n_context": 1000,
             "rounds": [{"ratio": 0.1, "agrees_full": agrees}]} for i, agrees in enumerate((True, False))]
    verify = {("t", i, 2): {"n_context": 100} for i in range(2)}
    probs = {("t", 0, 2): {"probs": {"m": {"0.1000": [0.9, 0.4, 0.01]}}},   # unlikely only past 2 tokens
             ("t", 1, 2): {"probs": {"m": {"0.1000": [0.9, 0.15]}}}}
    v = cal.replay_verify_p(rows, verify, probs, (0.1,), 2, tau=0.3, n_tokens=2)
    assert v["agreement"] == 1.0 and v["fallback"] == 0.5  # 0 accepted (right), 1 sent to full prefill
    assert v["cost"] == pytest.approx((0.2 + 1.2) / 2)
    v = cal.replay_verify_p(rows, verify, probs, (0.1,), 2, tau=0.1, n_tokens=2)
    assert v["agreement"] == 0.5 and v["fallback"] == 0  # a lower bar accepts the wrong round too
    assert cal.replay_verify_p(rows, verify, probs, (0.1,), 2, tau=0.3, n_tokens=3)["fallback"] == 1.0
