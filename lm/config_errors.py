"""jsonargparse's errors as one line, with the closest valid key suggested for an unknown one.

Its own file so that a command's bad argument is reported without importing torch and Lightning
(lm.training.config does).
"""

import difflib
import re

from jsonargparse import ArgumentParser


def known_keys(parser: ArgumentParser) -> list[str]:
    """Every dotted key the parser accepts (model.d_model, optim.lr, ...)."""
    keys = []
    for action in parser._actions:
        keys += [s.lstrip("-") for s in action.option_strings if s.startswith("--")]
    return keys


def error_line(parser: ArgumentParser, err: Exception) -> str:
    """jsonargparse's error as one line, with the closest valid key suggested for an unknown one."""
    message = " ".join(str(err).split())
    unknown = re.findall(r"Group '([\w.]+)' does not accept option '(\w+)'", message)
    names = [f"{group}.{option}" for group, option in unknown]
    names += re.findall(r"Option '([\w.]+)' is not accepted", message)
    names += re.findall(r"--([\w.]+)", message.split("unrecognized arguments:", 1)[1]) \
        if "unrecognized arguments:" in message else []
    if names:
        hints = []
        for name in names:
            close = difflib.get_close_matches(name, known_keys(parser), n=1, cutoff=0.5)
            hints.append(f"unknown config key '{name}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        return "; ".join(hints)
    return message[:400]
