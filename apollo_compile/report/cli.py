"""Command line: ``python -m apollo_compile report MODULE_PATH:FUNCTION --out report.html``.

``MODULE_PATH`` is a Python file (``examples/clip.py``) or an importable module name
(``mypkg.models``); ``FUNCTION`` takes no arguments and returns ``(model, example_inputs)`` or
``(model, example_inputs, options)``. ``example_inputs`` is a tuple or list of positional inputs,
a dict of keyword inputs (a Hugging Face batch: ``{"input_ids": ..., "pixel_values": ...,
"return_loss": True}``), or one input. The model is compiled with apollo and run once
(:func:`apollo_compile.explain`); the text table goes to stdout, the HTML page to ``--out``, the
predicted timeline as a Chrome/Perfetto trace to ``--trace``.

``--option key=value`` (repeatable) sets an apollo option, overriding the function's options;
the value is read as a Python literal (``max_lanes=1``, ``strict=True``,
``modalities={'vision': 'vision'}``) and otherwise kept as a string (``device=H200``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Mapping, Sequence


def parse_option(text: str) -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, value)``; value by ``ast.literal_eval``, else the string itself."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key, value


def load_function(spec: str) -> Callable[[], Any]:
    """``"path/to/file.py:build"`` or ``"package.module:build"`` -> the function."""
    module_path, sep, func_name = spec.rpartition(":")
    if not sep or not module_path or not func_name:
        raise SystemExit(f"apollo_compile report: expected MODULE_PATH:FUNCTION, got {spec!r}")
    if module_path.endswith(".py") or os.sep in module_path or os.path.exists(module_path):
        path = os.path.abspath(module_path)
        if not os.path.isfile(path):
            raise SystemExit(f"apollo_compile report: no such file {module_path!r}")
        name = "_apollo_report_" + os.path.splitext(os.path.basename(path))[0]
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_path)
    try:
        return getattr(module, func_name)
    except AttributeError:
        raise SystemExit(f"apollo_compile report: {module_path} has no function {func_name!r}") from None


def explain_target(spec: str, options: Mapping[str, Any] | None = None):
    """:func:`~apollo_compile.explain` of the model that ``MODULE_PATH:FUNCTION`` builds, with
    `options` set over the function's own; returns the :class:`~.explain.Report`."""
    from .explain import explain

    built = load_function(spec)()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise SystemExit("apollo_compile report: the function must return (model, example_inputs) or "
                         f"(model, example_inputs, options), got {type(built).__name__}")
    model, inputs = built[0], built[1]
    if isinstance(inputs, Mapping):
        positional, keywords = (), dict(inputs)
    else:
        positional, keywords = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), {}
    merged = dict(built[2] or {}) if len(built) == 3 else {}
    merged.update(options or {})
    return explain(model, *positional, options=merged, **keywords)


def report_command(args: argparse.Namespace) -> int:
    report = explain_target(args.target, dict(args.option or ()))
    print(report, end="")
    report.save_html(args.out)
    print(f"wrote {args.out}")
    if args.trace:
        report.save_trace(args.trace)
        print(f"wrote {args.trace}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m apollo_compile", description="apollo_compile tools")
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="compile a model with apollo and write an HTML report of the plan",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    rep.add_argument("target", metavar="MODULE_PATH:FUNCTION",
                     help="a .py file or module and a function returning (model, example_inputs[, options]); "
                          "example_inputs: a tuple of positional inputs, a dict of keyword inputs, or one input")
    rep.add_argument("--out", default="report.html", help="the HTML page to write (default: report.html)")
    rep.add_argument("--trace", default=None, help="also write the predicted timeline as Chrome trace JSON")
    rep.add_argument("--option", action="append", type=parse_option, metavar="KEY=VALUE",
                     help="an apollo option (repeatable); the value is a Python literal or a string")
    rep.set_defaults(func=report_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
