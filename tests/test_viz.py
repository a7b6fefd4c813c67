"""`kvstitch viz`: the side-by-side token picture, as HTML (also rendered in headless Chromium) and PNG."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import typer
from typer.testing import CliRunner

import kvstitch
from kvstitch.tasks.tasks import generate
from kvstitch.eval.viz import render_html, selection_picture, write_picture

from .conftest import make_tiny_engine

PNG = b"\x89PNG\r\n\x1a\n"
WANTED = ["full", "naive", "random", "prophet", "oracle", "infoflow_reorder"]


def _methods() -> list[str]:
    return [m for m in WANTED if m in kvstitch.methods()]


@pytest.fixture(scope="module")
def picture(smollm_tokenizer):
    eng = make_tiny_engine("llama", smollm_tokenizer)
    s = generate("two_hop", 1, 200, 64, 0, lambda t: len(smollm_tokenizer.encode(t)), depth=0.5)[0]
    return selection_picture(eng, s.question, s.chunks, _methods(), 0.2, s.answers, "two_hop", s.meta["inserts"],
                             s.meta["answer_prefix"], with_answers=True, max_new_tokens=4)


class _Columns(HTMLParser):
    """Collects every method column and the token spans inside it."""

    def __init__(self):
        super().__init__()
        self.cols: dict[str, dict] = {}
        self._cur: str | None = None
        self._depth = 0
        self.body: dict = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = a
        if tag == "section" and "method-col" in a.get("class", ""):
            self._cur, self._depth = a["data-method"], 0
            self.cols[self._cur] = {"tokens": 0, "selected": 0, "answer_role": 0}
        if self._cur is not None:
            self._depth += 1
            classes = a.get("class", "").split()
            if tag == "span" and "t" in classes:
                c = self.cols[self._cur]
                c["tokens"] += 1
                c["selected"] += "sel" in classes
                c["answer_role"] += "r-answer" in classes

    def handle_endtag(self, tag):
        if self._cur is not None:
            self._depth -= 1
            if self._depth == 0:
                self._cur = None


def _parse(page: str) -> _Columns:
    p = _Columns()
    p.feed(page)
    return p


def test_html_has_every_method_column(picture):
    page = render_html(picture)
    cols = _parse(page).cols
    n = len(picture.tokens)
    budget = round(0.2 * n)
    assert list(cols) == _methods()
    for m, c in cols.items():
        assert c["tokens"] == n, m  # every column shows the whole prompt context
        assert c["answer_role"] > 0  # the answer-bearing fact is marked
    assert cols["full"]["selected"] == n and cols["naive"]["selected"] == 0
    for m in set(cols) - {"full", "naive"}:
        assert cols[m]["selected"] == budget, m
    assert "<script src" not in page and "<link" not in page  # self-contained
    assert "".join(picture.tokens).count("house is in") >= 2  # token texts reassemble the prompt
    # shades follow the scores: query-driven methods carry per-token scores, naive has none
    if "prophet" in cols:
        pm = next(p for p in picture.methods if p.method == "prophet")
        assert pm.shade is not None and min(pm.shade) == 0.0 and max(pm.shade) == 1.0
        assert pm.answer is not None
        if "oracle" in kvstitch.methods():
            assert 0.0 <= pm.overlap <= 1.0


def _chromium() -> str:
    """The Chromium binary. `scripts/setup.sh` installs it; a test never installs system packages, so a
    missing binary fails (never skips) with the command that fixes it."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is required for the viz render test and is not on PATH: run "
                "`bash scripts/setup.sh` (or `apt-get install -y chromium` on Debian) and rerun")


def _run_chromium(binary: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", "--no-first-run", "--disable-extensions", "--mute-audio", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"chromium failed ({r.returncode}):\n{r.stderr[-2000:]}"
    return r


def test_html_renders_in_headless_chromium(picture, tmp_path):
    binary = _chromium()
    html_path, png_path = write_picture(picture, tmp_path / "sel.html", tmp_path / "sel.png")
    assert png_path.read_bytes()[:8] == PNG
    url = html_path.resolve().as_uri()
    width = 380 * len(picture.methods) + 60

    dom = _run_chromium(binary, f"--window-size={width},1200", "--virtual-time-budget=3000", "--dump-dom", url).stdout
    parsed = _parse(dom)
    assert list(parsed.cols) == _methods()  # every column survived rendering
    layout = json.loads(parsed.body["data-layout"])  # written by the page's own script after layout
    assert [c["method"] for c in layout] == _methods()
    for c in layout:
        assert c["w"] > 100 and c["h"] > 100, c  # each column is really drawn
    xs = [c["x"] for c in layout]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)  # side by side, in method order
    assert len({c["y"] for c in layout}) == 1  # on one row
    sel = {c["method"]: c["selected"] for c in layout}
    assert sel["naive"] == 0 and sel["full"] == len(picture.tokens)

    shot = tmp_path / "shot.png"
    _run_chromium(binary, f"--window-size={width},900", f"--screenshot={shot}", url)
    assert shot.read_bytes()[:8] == PNG
    from matplotlib.image import imread

    img = imread(str(shot))[..., :3]
    assert img.shape[1] == width
    red = (img[..., 0] > 0.45) & (img[..., 1] < 0.35) & (img[..., 2] < 0.35)
    assert red.sum() > 50, "no recomputed (red) tokens visible in the screenshot"
    assert img.std() > 0.05  # not a blank page


def test_viz_command_wiring(smollm_tokenizer, tmp_path, monkeypatch):
    """`kvstitch viz` as the CLI will mount it (the model load is replaced by the tiny engine)."""
    from kvstitch.engine import Engine
    from kvstitch.cli.viz import viz_command

    eng = make_tiny_engine("llama", smollm_tokenizer)
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: eng))
    app = typer.Typer()
    app.command("viz")(viz_command)
    app.command("noop")(lambda: None)
    out = tmp_path / "sel.html"
    methods = ",".join(m for m in ("naive", "random", "prophet") if m in kvstitch.methods())
    r = CliRunner().invoke(app, ["viz", "--method", methods, "--task", "niah_single_essay", "--length", "160",
                                 "--chunk-tokens", "64", "--no-answers", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert list(_parse(out.read_text()).cols) == methods.split(",")
    assert out.with_suffix(".png").read_bytes()[:8] == PNG
    bad = CliRunner().invoke(app, ["viz", "--method", "nope", "--out", str(out)])
    assert bad.exit_code != 0
