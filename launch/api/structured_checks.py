"""Grammars and tools checked at the edge, before the engine sees them.

Each grammar (response_format, guided_*, a forced tool call) is compiled here exactly as the last
stage will compile it (`dist_glm5.sampling.grammar.check`: the same llguidance matcher under the
same limits, then a short walk), so one that is invalid, too large for the limits or cannot be
satisfied is a 400 naming its field instead of a 500 or an error mid-stream. Tool `parameters`
must be JSON Schema (checked by `jsonschema` against its meta-schema, `pattern`s as regexes).

These run in the request-building function, which the server calls off its event loop; the
slow parts (llguidance's build and mask) drop the GIL.
"""

from __future__ import annotations

import logging

from dist_glm5.sampling.grammar import GrammarError, GrammarSpec, check

from .errors import ApiError

log = logging.getLogger(__name__)


def check_grammar(spec: GrammarSpec, tokenizer, param: str) -> None:
    """A 400 naming `param` if the last stage could not serve this grammar."""
    if tokenizer is None:
        raise ApiError(400, f"{param}: structured output needs the model's tokenizer", param)
    try:
        dt = check(spec, tokenizer)
    except GrammarError as e:
        log.info("refused a %s grammar (%s): %s", spec.kind, e.why, e)
        raise ApiError(400, f"{param}: {e}", param) from None
    if dt > 0.1:
        log.info("a %s grammar took %.0f ms to check", spec.kind, dt * 1e3)


def check_tool_parameters(i: int, parameters: dict | None) -> None:
    """A 400 naming `tools.i.function.parameters` if they are not a JSON Schema (by the draft
    their `$schema` names, else 2020-12, what OpenAI's function schemas are)."""
    if parameters is None:
        return
    import jsonschema

    param = f"tools.{i}.function.parameters"
    if not isinstance(parameters.get("$schema", ""), str):
        raise ApiError(400, f"{param}: $schema must be a string (a meta-schema's URI)", param)
    cls = jsonschema.validators.validator_for(parameters, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(parameters)  # with the draft's format checker: patterns must compile
    except jsonschema.SchemaError as e:
        where = e.json_path if e.json_path != "$" else "the top level"
        raise ApiError(
            400, f"{param} is not a valid JSON Schema: {e.message[:300]} (at {where})", param
        ) from None
    except RecursionError:
        raise ApiError(400, f"{param} is nested too deeply", param) from None


def tool_grammar(tools, named: list[str], max_calls: int, tokenizer) -> GrammarSpec:
    """The grammar forcing calls of the `named` functions (of `tools`, the request's), at least
    one and at most `max_calls` (0: any number), checked. Each function's own grammar is checked
    first, so a fault is named by its `tools.N.function.parameters`; then the whole, which must
    fit the limits too."""
    index = {t.function.name: i for i, t in enumerate(tools)}
    functions = [
        {"name": k, "parameters": tools[index[k]].function.parameters or {}} for k in named
    ]
    params = [f"tools.{index[k]}.function.parameters" for k in named]
    for f, param in zip(functions, params):
        check_grammar(GrammarSpec.tool_calls([f], 1, 1), tokenizer, param)
    spec = GrammarSpec.tool_calls(functions, 1, max_calls)
    if len(functions) > 1 or max_calls != 1:
        check_grammar(spec, tokenizer, "tools" if len(functions) > 1 else params[0])
    return spec
