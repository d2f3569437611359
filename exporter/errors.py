"""Errors the CLI turns into exit code 2 with one line naming the problem.

Anything raised as InputError is the user's input being wrong (a flag, a preset name, a config
file); every other exception is a bug or an environment failure and exits 1.
"""


class InputError(ValueError):
    """Bad input: the message names what is wrong and where."""


class UnsupportedModelError(InputError):
    """The model's attention kind is one the capacity model cannot describe (SSM, linear hybrids)."""
