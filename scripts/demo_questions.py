"""Which demo questions the embedded model answers correctly with FULL prefill: the demo keeps only those.

    python scripts/demo_questions.py        # True/False (expected text in full prefill's answer), question, answer

It checks the bundled questions plus the candidates below (ones full prefill failed were dropped from the demo
for that reason alone, never because a stitched method failed them).
"""

import json
from importlib import resources

import torch

from kvstitch import Engine

CANDIDATES = [
    {"question": "How long does the ferry crossing to Skerra take?", "answer": "forty minutes"},
    {"question": "What is Mira Castell's favourite bread?", "answer": "rye with caraway seeds"},
    {"question": "Who runs the Mill Street bakery?", "answer": "Mira Castell"},
    {"question": "How many residents does Skerra have?", "answer": "three hundred"},
    {"question": "How long is the Ashwater river?", "answer": "ninety kilometres"},
    {"question": "How many red deer live in the Corran hills?", "answer": "two hundred"},
]


def main() -> None:
    torch.set_num_threads(1)
    demo = json.loads(resources.files("kvstitch").joinpath("data/samples/demo.json").read_text())
    eng = Engine.load()
    for q in demo["questions"] + CANDIDATES:
        r = eng.generate(q["question"], demo["passages"], method="full", max_new_tokens=24)
        print(q["answer"].lower() in r.text.lower(), repr(q["question"]), repr(r.text), flush=True)


if __name__ == "__main__":
    main()
