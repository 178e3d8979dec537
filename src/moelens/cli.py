"""The ``moelens`` command.

Each feature area adds its subcommands from its own module: a module listed in
`COMMAND_MODULES` (``moelens.commands``) defines ``register(subparsers)``, adding parsers whose
``func(args) -> int`` imports the command's body and runs it (`moelens.commands.runs`), so the
parsers import no model library. Errors moelens raises on purpose are
printed as one clear line (exit status 2), not a traceback. `quiet_transformers`
keeps transformers' logging and progress bars out of every command's output.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import sys
import warnings
from typing import Any, Callable

from .errors import MoelensError, sentence
from .paths import user_path

#: Modules that add subcommands (``demo``, ``inspect``, ``stats``, ``generate``, ``export`` ...).
COMMAND_MODULES = ("moelens.commands.analysis", "moelens.commands.generate", "moelens.commands.export")


def quiet_transformers() -> None:
    """Keep transformers' logging and its "Loading weights" bar out of a command's output.

    For the command only: ``moelens.load`` called from Python leaves transformers' settings as they are.
    """
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


#: How wrap's warnings about a model with no MoE block it serves begin (`load_checkpoint` leaves them to the
#: command's error).
NO_MOE_WARNINGS = ("moelens found no MoE block", "moelens does not serve these MoE blocks")

#: How moelens.load's warning about saved tokenizer files that do not load begins (`load_checkpoint` leaves it to the
#: error of a command that needs the tokenizer).
TOKENIZER_WARNING = "moelens.load: the tokenizer saved at"

#: A warning `moelens.load` gave, and the exception being handled when it was given (for the tokenizer warning:
#: why the tokenizer files did not load), or None.
CaughtWarning = tuple[warnings.WarningMessage, BaseException | None]


def load_checkpoint(source: str | None, needs_tokenizer: bool = False) -> tuple[Any, str]:
    """Load a command's MODEL: ``tiny`` (the embedded moelens-tiny, unless a folder of that name is there) or a
    checkpoint folder, wrapped; None: moelens-tiny whatever the working folder holds (the demo's model).

    ``needs_tokenizer``: the command routes text, so a served MoE model without a tokenizer is refused (a model
    with no served MoE block is left to the command's own error).

    Returns:
        The wrapped model and the name to show for it.

    Raises:
        MoelensError: moelens-tiny is not installed, or ``source`` is missing, a file, or a folder
            without config.json (and whatever `moelens.load` refuses); with ``needs_tokenizer``, the model has
            no tokenizer (no tokenizer files, or files that do not load: the error names why).
    """
    import moelens
    from moelens.data import TINY_MODEL_PATH, TINY_NAMES

    quiet_transformers()
    if source is None or source in TINY_NAMES and not user_path(source, "MODEL").is_dir():  # a folder "tiny" wins
        if not (TINY_MODEL_PATH / "config.json").is_file():
            raise MoelensError(
                f"moelens-tiny is not installed at {TINY_MODEL_PATH} (config.json is missing); reinstall "
                "moelens, or train it with scripts/train_tiny.py."
            )
        path, name = TINY_MODEL_PATH, "moelens-tiny"
    else:
        path, name = user_path(source, "MODEL"), source
        if not path.exists():  # a command takes local folders only (moelens.load would try a hub id)
            raise MoelensError(f"no model at {source!r}: the path does not exist. Pass a local checkpoint folder or 'tiny'.")
    try:  # no checkpoint code runs here (transformers would ask on the terminal, then refuse)
        model, caught = _load_catching(functools.partial(moelens.load, trust_remote_code=False), path)
    except MoelensError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise MoelensError(
            f"{name!r} holds a model with code of its own (config.json's auto_map), which moelens commands do not "
            "run; load it in Python, moelens.load(path, trust_remote_code=True), if you trust that code."
        ) from None
    if getattr(model._module.config, "auto_map", None):  # code of its own for a model type transformers knows
        warnings.warn(f"{name!r} holds code of its own (config.json's auto_map), which moelens commands do not run: "
                      f"transformers' own {type(model._module).__name__} runs in its place; load it in Python, "
                      "moelens.load(path, trust_remote_code=True), to run that code, if you trust it.")
    refused = not model.moes  # each command refuses such a model in one line that says why: no warning before it
    untokenized = needs_tokenizer and not refused and getattr(model, "tokenizer", None) is None
    unloaded = [(warning, cause) for warning, cause in caught if str(warning.message).startswith(TOKENIZER_WARNING)]
    held = NO_MOE_WARNINGS if refused else TOKENIZER_WARNING if untokenized else None  # what the error says
    for warning, _ in caught:
        if not (held and str(warning.message).startswith(held)):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if untokenized:
        raise MoelensError(_no_tokenizer(name, str(path), unloaded[0] if unloaded else None))
    return model, name


def _load_catching(load: Callable[[Any], Any], path: Any) -> tuple[Any, list[CaughtWarning]]:
    """``load(path)``, and every warning it gave with the exception being handled at the time (`CaughtWarning`)."""
    caught: list[CaughtWarning] = []

    def keep(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        caught.append((warnings.WarningMessage(message, category, filename, lineno, file, line), sys.exc_info()[1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        model = load(path)
    return model, caught


def _no_tokenizer(name: str, path: str, unloaded: CaughtWarning | None) -> str:
    """Why the model ``name`` (its folder ``path``) routes no text: no tokenizer files, or the files there do not
    load (``unloaded``: moelens.load's warning about them and its cause)."""
    if unloaded is None:
        return f"{name!r} has no tokenizer, so its text cannot be routed; save one with the model."
    warning, cause = unloaded
    why = f"{type(cause).__name__}: {sentence(cause)}" if cause is not None else str(warning.message)
    return (f"the tokenizer saved at {path!r} does not load ({why}), so text cannot be routed through {name!r}; fix "
            "or re-save the tokenizer files there (tokenizer.save_pretrained(folder) with a tokenizer that loads).")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="moelens",
        description="Look inside Mixture-of-Experts language models: routing, experts, export.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or not name.startswith(error.name):
                raise
            continue  # that feature area is not installed in this build
        module.register(subparsers)
    for command in subparsers.choices.values():
        command.set_defaults(options={action.dest: action.option_strings[-1] for action in command._actions
                                      if action.option_strings and action.dest != "help"})
    return parser


#: A setting in a moelens message, as the Python API spells it: ``Edits.steer[1]`` (group 1, 2), ``dynamic_tokens=True``
#: (group 3), ``max_length=9999`` (group 4) or a bare ``route_around`` (group 5; names with an underscore only,
#: since a bare "tokens" is a word of the message's prose). Not a part of a path or file name: no slash,
#: backslash, ~, dot or quote right before it, no slash, backslash, quote or .suffix right after a bare name.
API_SPELLING = re.compile(
    r"Edits\.(\w+)\[(-?\d+)\]|(?<![\w.(\-'\"/\\~])(?:(\w+)=True\b|(\w+)=|(\w+_\w+)\b(?![(/'\"\\]|\.\w))"
)


#: Quoted text in a message (a path, a Python string): an opening quote has no letter before it ("model's" opens none).
QUOTED = re.compile(r"(?<!\w)'[^'\n]*'|\"[^\"\n]*\"")


def spelled_as_options(message: str, options: dict[str, str]) -> str:
    """``message`` with the settings the command has options for spelled as those options.

    The command passes its options to the Python API, whose errors name the API's settings
    (``max_length=9999``, ``use route_around``); the command's user types ``--max-length``.
    Code the message quotes stays Python: the arguments of a call (``to_nnef(model, path,
    dynamic_tokens=True)``) and quoted text (``ablate(moe, e, "route_around")``, a path).
    """
    quoted = [span.span() for span in QUOTED.finditer(message)]

    def respell(match: re.Match[str]) -> str:
        edit, layer, flag, valued, bare = match.groups()
        name = edit or flag or valued or bare
        inside_quotes = any(start < match.start() < end for start, end in quoted)
        if name not in options or inside_quotes or _in_call(message, match.start()):
            return match.group(0)
        if edit:
            return f"{options[name]} of layer {layer}"
        return options[name] + (" " if valued else "")

    return API_SPELLING.sub(respell, message)


def _in_call(message: str, position: int) -> bool:
    """Whether ``position`` lies inside the parentheses of a call in ``message`` (``name(...)``), not of prose."""
    depth = 0
    for index in range(position - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(message[index], 0)
        if depth < 0:  # the innermost parenthesis open here: a call when a name comes right before it
            return index > 0 and (message[index - 1].isalnum() or message[index - 1] == "_")
    return False


class ReaderMayLeave:
    """A command's stdout whose reader may stop early (``moelens stats ... | head -1``): from then on what the
    command prints goes nowhere, and the command goes on to finish the files it writes (``--out``, OUT)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.gone = False  # whether the reader has stopped

    def write(self, text: str) -> int:
        """Write ``text`` to stdout, unless its reader has stopped."""
        self._guarded(self.stream.write, text)
        return len(text)

    def flush(self) -> None:
        """Flush stdout, unless its reader has stopped."""
        self._guarded(self.stream.flush)

    def _guarded(self, call: Any, *args: Any) -> None:
        """``call(*args)`` on stdout, until its reader has stopped: then stdout's file is /dev/null, so that what
        is left in its buffer goes where the rest goes and no later flush raises again."""
        if self.gone:
            return
        try:
            call(*args)
        except BrokenPipeError:
            self.gone = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    """Run the ``moelens`` command; returns the exit status (1 when the reader of stdout stopped early).

    Raises:
        SystemExit: argparse's own exit (``--help``, ``--support``, a command line it cannot parse).
    """
    stdout = sys.stdout = ReaderMayLeave(sys.stdout)  # from the start: --help and --support print while parsing
    try:
        status = _run(argv)
    finally:
        stdout.flush()  # now, not at exit, where a reader gone would end in "Exception ignored ... BrokenPipeError"
        sys.stdout = stdout.stream
    return 1 if stdout.gone and status == 0 else status


def warning_printer(command: str, options: dict[str, str]) -> Callable[..., None]:
    """A `warnings.showwarning` for ``moelens COMMAND``: each warning one line on stderr,
    ``moelens COMMAND: warning: MESSAGE``, the API's settings spelled as the command's ``options``."""

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        print(f"moelens {command}: warning: {spelled_as_options(str(message), options)}", file=sys.stderr)

    return show


def _run(argv: list[str] | None) -> int:
    """Parse ``argv`` and run the command; errors moelens raises on purpose are one line on stderr, status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 1
    try:
        with warnings.catch_warnings():  # shown as the command's own lines, not Python's (file, line, source)
            warnings.showwarning = warning_printer(args.command, args.options)
            return int(args.func(args) or 0)
    except MoelensError as error:
        print(f"moelens {args.command}: error: {spelled_as_options(str(error), args.options)}", file=sys.stderr)
        return 2
    except OSError as error:  # a path the checks could not foresee (a folder the system refuses to create ...)
        print(f"moelens {args.command}: error: {error}; check the path and what may be written there.", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a line, not the traceback of wherever the model was
        print(f"\nmoelens {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
