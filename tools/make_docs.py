"""Write docs/profiles.md, the profile reference, from the code that reads a profile
(specdraft/commands/profile_reference.py); the file is never edited by hand.

    python tools/make_docs.py           # rewrite docs/profiles.md
    python tools/make_docs.py --check   # exit 1 when docs/profiles.md is not what it would write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdraft.commands.profile_reference import profile_reference  # noqa: E402

TARGET = ROOT / "docs" / "profiles.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = profile_reference()
    current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else None
    if args.check:
        if current != text:
            print(f"{TARGET.relative_to(ROOT)} is stale: run `python tools/make_docs.py`", file=sys.stderr)
            return 1
        print(f"{TARGET.relative_to(ROOT)} is current")
        return 0
    if current != text:
        TARGET.parent.mkdir(parents=True, exist_ok=True)
        TARGET.write_text(text, encoding="utf-8")
        print(f"wrote {TARGET.relative_to(ROOT)}")
    else:
        print(f"{TARGET.relative_to(ROOT)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
