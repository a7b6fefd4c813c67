"""Save the test suite's tiny random model of a family (tests/conftest.py, SmolLM2's tokenizer) as a Hugging Face
directory, so `kvstitch eval --model DIR` can run the same fixed-seed slice on two trees (a refactor's check).

    python scripts/save_tiny_model.py /tmp/tiny-llama [--family llama]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from transformers import AutoTokenizer

    from kvstitch.models.loader import resolve_model
    from tests.conftest import TINY, make_tiny_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--family", default="llama", choices=TINY)
    args = ap.parse_args()
    path, _ = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(str(path))
    eng = make_tiny_engine(args.family, tok)
    eng.model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"tiny {args.family} model -> {args.out}")


if __name__ == "__main__":
    main()
