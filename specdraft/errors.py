"""The exceptions the command line turns into one-line messages and exit codes.

ProfileError and UsageError exit 2 (the user must fix an input); SpecdraftError exits 1
(something failed while running). Nothing else should reach the user as a traceback.
Terminated is SIGTERM raised as an interrupt (see commands/io.py `sigterm_interrupts`).
"""

from __future__ import annotations


class SpecdraftError(Exception):
    """A runtime failure: exit code 1."""

    exit_code = 1


class UsageError(SpecdraftError):
    """Bad command-line usage or input (empty prompt, unreadable data): exit code 2."""

    exit_code = 2


class ProfileError(UsageError):
    """An invalid TOML profile; the message names the file and the key path."""

    def __init__(self, file: str | None, key: str | None, message: str):
        self.file, self.key = file, key
        where = ": ".join(part for part in (file, key) if part)
        super().__init__(f"{where}: {message}" if where else message)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that code which saves its
    work on Ctrl-C (the training loop) does the same on SIGTERM; exits 143 (128 + SIGTERM)."""


class NonFiniteLogits(UsageError):
    """The target computed NaN or infinite logits: its weights are not finite numbers (a
    damaged or hostile model file). Exit 2, like any file that is not a usable model."""

    def __init__(self) -> None:
        super().__init__("the target's logits are not finite numbers: its weights hold NaN or infinite values "
                         "(a damaged model file?)")
