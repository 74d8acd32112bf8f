"""The examples every command's `--help` ends with (as simonw/llm shows them): a few command
lines a user can adapt, each checked by tests/test_cli.py to parse against the command's
own options, so an example cannot name a flag that is gone."""

from __future__ import annotations

from rich.markup import escape

EXAMPLES: dict[str, tuple[str, ...]] = {
    "generate": (
        'specdraft generate -m model.gguf "Write a haiku about caches"',
        'cat notes.txt | specdraft generate -m model.gguf "Summarise this"',
        "cat prompts.txt | specdraft generate --pool my.toml --each-line --json > out.jsonl",
        'specdraft generate -m model.gguf --temperature 0.7 --repeat-penalty 1.1 --stats "Tell a story"',
    ),
    "chat": (
        'specdraft chat -m model.gguf --system "You answer briefly."',
        "printf 'Hi!\\nAnd again?\\n' | specdraft chat -m model.gguf --json",
    ),
    "bench": (
        "specdraft bench -m model.gguf --data prompts.jsonl --quick",
        "specdraft bench --pool my.toml --data prompts.jsonl --policies normalhedge,fixed:lookup --out r.json",
        "specdraft bench --pool my.toml --data prompts.jsonl --baseline transformers,llama.cpp --csv r.csv",
    ),
    "trace": ("specdraft trace --pool my.toml --data prompts.jsonl --out trace.jsonl",),
    "export": ("specdraft export --pool my.toml --out exported/",),
    "serve": (
        "specdraft serve -m model.gguf --port 8000",
        "specdraft serve --engine vllm --pool my.toml --port 8000",
    ),
    "calibrate-beta": ("specdraft calibrate-beta --pool my.toml --data calib.jsonl --write",),
    "profile init": ("specdraft profile init model.gguf > my.toml",),
    "calibrate costs": ("specdraft calibrate costs -m model.gguf",),
    "datastore build": ("specdraft datastore build --pool my.toml --out store/ docs/ src/",),
    "train head": (
        "specdraft train head -m model.gguf --data answers.jsonl",
        "specdraft train head --pool my.toml --data code.jsonl src/ --out heads/code --fuse-layers 2,15",
    ),
    "train steer": ("specdraft train steer --pool my.toml --drafter small --data answers.jsonl --out steer/",),
}


def epilog(command: str) -> str:
    """The `--help` epilog of `command` ("generate", "train head", ...): its examples."""
    lines = "\n\n".join(escape(line) for line in EXAMPLES[command])
    return f"[bold]Examples[/]\n\n{lines}"
