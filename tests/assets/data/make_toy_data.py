"""Generate the toy training files used by the trainer tests and the tiny recipes (run from anywhere).

toy_sft.jsonl  {prompt, response}: reverse a digit string ("reverse 3141" -> "1413"), learnable by a tiny model.
toy_pref.jsonl {prompt, chosen, rejected}: the reversed string is chosen over letters of the same length (a
               preference a tiny random model can pick up within a few dozen steps).
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def rows(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        s = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 8)))
        yield s


def main():
    with open(HERE / "toy_sft.jsonl", "w") as f:
        for s in rows(128, 0):
            f.write(json.dumps({"prompt": f"reverse {s}", "response": s[::-1]}) + "\n")
    rng = random.Random(2)
    with open(HERE / "toy_pref.jsonl", "w") as f:
        for s in rows(64, 1):
            wrong = "".join(rng.choice("abcdefghij") for _ in s)
            f.write(json.dumps({"prompt": f"reverse {s}", "chosen": s[::-1], "rejected": wrong}) + "\n")


if __name__ == "__main__":
    main()
