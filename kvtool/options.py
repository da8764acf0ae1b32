"""Command-line option values, checked in one place before a command runs.

`kvtool.cli.common.handle_errors` calls `check_options(command, values)` with every command's parsed parameters (by
Python name), so a rule here holds for every command that has the option, and a bad value is an `OptionError`
(one line, exit 2) before any work. The rules are data (`RULES`), not code in each command:

- counts (`--topk`, `--block-size`, `--page-size`, `--batch`, `--heads`, `--dim`, ...) are integers >= 1; `--local`,
  `--init`, `--gen-tokens` >= 0. A 0 never means "the default".
- thresholds (`--max-rel-l2`, `--max-abs`, `--max-scale-mismatch`, `--tolerance`) are >= 0 (a negative one could
  never pass: it is a typo, not a check that failed); `--min-sqnr` is a number; sizes (`--chunk-mb`, `--mem-gb`,
  `--pool-gb`, `--size`) are > 0. NaN is never a valid value.
- `--device` is cpu, cuda or cuda:N.
- formats: the target label and the recipe flags must agree (the registry refuses a label that repeats an option or
  a flag that contradicts it: `--to mxfp4-floor --scale-rule rceil`), and an explicit NVFP4 outer scale (flag or
  `-gVALUE` label) lies in [2^-64, 2^64] (`OUTER_RANGE`): a value such as 1e-30 saturates every E4M3 block scale and
  decodes every element to ~0.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from kvtool.errors import KvtoolError

__all__ = [
    "DEVICE_PATTERN", "FINITE", "FORMAT_LIST_OPTIONS", "NON_NEGATIVE", "NON_NEGATIVE_INT", "OUTER_RANGE",
    "OptionError", "POSITIVE", "POSITIVE_INT", "RULES", "Rule", "check_format", "check_options",
    "check_outer_scale", "option_name",
]

OUTER_RANGE = (2.0 ** -64, 2.0 ** 64)
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")
FORMAT_LIST_OPTIONS = ("formats", "kv", "index", "baseline_kv", "baseline_index", "kv_dense")


class OptionError(KvtoolError):
    """An option value out of its range, or options that contradict each other."""


@dataclass(frozen=True)
class Rule:
    what: str  # how the message states the rule: "--topk must be <what>"
    ok: Callable[[object], bool]


def _int_at_least(lo: int) -> Rule:
    return Rule(f"an integer >= {lo}", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo)


def _float_rule(what: str, test: Callable[[float], bool]) -> Rule:
    return Rule(what, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
                and test(float(v)))


POSITIVE_INT = _int_at_least(1)
NON_NEGATIVE_INT = _int_at_least(0)
NON_NEGATIVE = _float_rule("a number >= 0", lambda v: v >= 0)
POSITIVE = _float_rule("positive (a finite number > 0)", lambda v: math.isfinite(v) and v > 0)
FINITE = _float_rule("a finite number", math.isfinite)

# Parameter name (as the commands spell it in Python) -> rule. Strings (e.g. `--layers 0-3`) are not checked here.
RULES: dict[str, Rule] = {
    **{name: POSITIVE_INT for name in ("topk", "block_size", "page_size", "max_queries", "batch", "heads", "dim",
                                       "tp", "blocks", "max_tokens", "context", "model_layers", "tokens", "layers")},
    **{name: NON_NEGATIVE_INT for name in ("local", "init", "gen_tokens")},
    **{name: NON_NEGATIVE for name in ("max_rel_l2", "max_abs", "max_scale_mismatch", "tolerance")},
    **{name: POSITIVE for name in ("chunk_mb", "mem_gb", "pool_gb", "size")},
    "min_sqnr": FINITE,
}


def option_name(param: str) -> str:
    return "--" + param.replace("_", "-")


def check_options(command: str, values: dict) -> None:
    """Check every parsed option of `command` that has a rule; OptionError (exit 2) naming the option otherwise."""
    for param, value in values.items():
        rule = RULES.get(param)
        if rule is None or value is None or isinstance(value, str):
            continue
        if not rule.ok(value):
            raise OptionError(f"{option_name(param)} must be {rule.what}, got {value!r}")
    device = values.get("device")
    if isinstance(device, str) and not DEVICE_PATTERN.fullmatch(device.strip().lower()):
        raise OptionError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if isinstance(values.get("outer_scale"), str):
        check_outer_scale(values["outer_scale"], "--outer-scale")
    if isinstance(values.get("to"), str):
        check_format(values["to"], **{k: values.get(k) for k in ("scale_rule", "recipe", "outer_scale",
                                                                 "fp8_scale")})
    for param in FORMAT_LIST_OPTIONS:
        if isinstance(values.get(param), str):
            for label in filter(None, (item.strip() for item in values[param].split(","))):
                _check_label_outer(label, option_name(param))


def check_outer_scale(value: str, where: str) -> None:
    """An explicit NVFP4 outer scale: 1, auto, or a finite number in OUTER_RANGE."""
    text = str(value).strip().lower()
    if text == "auto":
        return
    try:
        g = float(text)
    except ValueError:
        raise OptionError(f"{where}: outer scale must be 1, auto or a positive number, got {value!r}") from None
    lo, hi = OUTER_RANGE
    if not (math.isfinite(g) and lo <= g <= hi):
        raise OptionError(f"{where}: outer scale must be a positive number in [2^-64, 2^64], got {value} (outside "
                          "it the E4M3 block scales saturate or underflow: every value decodes to ~0 or clips; auto "
                          "derives it from the tensor)")


def check_format(label: str, **flags):
    """Resolve `label` with the recipe flags (None = not given) through the registry, which refuses contradictions;
    then check an explicit outer scale. Returns the Format."""
    from kvtool.formats import get_format

    fmt = get_format(label, **{k: v for k, v in flags.items() if v is not None})
    outer = getattr(fmt, "outer_scale", None)
    if outer not in (None, "1", "auto"):
        check_outer_scale(outer, f"format {label}: outer scale")
    return fmt


def _check_label_outer(label: str, where: str) -> None:
    """A format in a comma list: only its explicit outer scale is checked here (the command resolves the rest)."""
    m = re.search(r"(?:^|-)g([^-@+]+)", label.strip().lower())
    if label.strip().lower().startswith(("nvfp4", "fp4")) and m:
        check_outer_scale(m.group(1), f"{where} {label}: outer scale")
