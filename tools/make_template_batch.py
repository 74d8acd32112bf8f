"""Writes benchmarks/data/template-batch.txt: 50 one-line prompts from one template, the kind
of batch people pipe through `specdraft generate --each-line` (a fixed JSON schema filled
from a free-text record). Deterministic: the same file every time.

    python tools/make_template_batch.py
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Alice Martin", "Bruno Silva", "Chen Wei", "Dana Cohen", "Emeka Obi", "Fatima Zahra", "Goran Petrov",
         "Hana Sato", "Ivan Horvat", "Julia Novak", "Kofi Mensah", "Lena Fischer", "Mateo Garcia", "Nina Berg",
         "Omar Haddad", "Priya Nair", "Quinn Walsh", "Rosa Lopez", "Sven Larsen", "Tara Singh"]
CITIES = ["Paris", "Lisbon", "Shanghai", "Haifa", "Lagos", "Rabat", "Sofia", "Osaka", "Zagreb", "Prague",
          "Accra", "Munich", "Madrid", "Oslo", "Beirut", "Kochi", "Dublin", "Seville", "Bergen", "Delhi"]
JOBS = ["nurse", "carpenter", "data analyst", "teacher", "pilot", "chef", "architect", "librarian", "electrician",
        "pharmacist"]
TEMPLATE = ("Extract the person from this note as JSON with the keys name, age, city and job, "
            "nothing else: \"{name} is {age} years old, lives in {city} and works as {job}.\"")


def _with_article(job: str) -> str:
    return f"{'an' if job[0] in 'aeiou' else 'a'} {job}"


def main() -> None:
    rng = random.Random(7)
    lines = [TEMPLATE.format(name=rng.choice(NAMES), age=rng.randrange(19, 80), city=rng.choice(CITIES),
                             job=_with_article(rng.choice(JOBS))) for _ in range(50)]
    out = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "template-batch.txt"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {out}")


if __name__ == "__main__":
    main()
