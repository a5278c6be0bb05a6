"""A local interpreter for the subset of Amazon States Language our state machines use.

Why: `moeplan run --verify` must execute the deployed definition itself (the same JSON that goes
into template.yaml), not a re-implementation of the plan. Supported: Task on
`arn:aws:states:::lambda:invoke` (Parameters with `.$` paths, ResultSelector, ResultPath `$` or
null, OutputPath), Parallel (branches run concurrently), Choice (IsPresent, BooleanEquals), Pass,
Succeed, Next / End.
Anything else is an error, so a definition the interpreter cannot run is never reported as verified.
States larger than Step Functions' 256 KB limit are refused, as the service would.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

STATE_LIMIT_BYTES = 256 * 1024


class ASLError(Exception):
    """The definition uses something unsupported, or an execution failed."""


def path_get(doc, path: str):
    """Value at a simple JSONPath ($, $.a.b); KeyError when absent."""
    if path == "$":
        return doc
    if not path.startswith("$."):
        raise ASLError(f"unsupported path {path!r}")
    for part in path[2:].split("."):
        doc = doc[part]
    return doc


def render(template, doc):
    """Parameters / ResultSelector: keys ending in `.$` take a path from doc."""
    if isinstance(template, dict):
        out = {}
        for k, v in template.items():
            if k.endswith(".$"):
                out[k[:-2]] = path_get(doc, v)
            else:
                out[k] = render(v, doc)
        return out
    if isinstance(template, list):
        return [render(v, doc) for v in template]
    return template


def _matches(rule: dict, doc) -> bool:
    """One Choice rule: IsPresent, or BooleanEquals (a missing or non-boolean variable is a runtime error)."""
    if set(rule) == {"Variable", "IsPresent", "Next"}:
        try:
            path_get(doc, rule["Variable"])
            present = True
        except (KeyError, TypeError):
            present = False
        return present == bool(rule["IsPresent"])
    if set(rule) == {"Variable", "BooleanEquals", "Next"}:
        try:
            value = path_get(doc, rule["Variable"])
        except (KeyError, TypeError):
            raise ASLError(f"choice variable {rule['Variable']} is missing (States.Runtime)") from None
        if not isinstance(value, bool):
            raise ASLError(f"choice variable {rule['Variable']} is not a boolean (States.Runtime)")
        return value == bool(rule["BooleanEquals"])
    raise ASLError(f"unsupported choice rule {sorted(rule)}")


class Machine:
    """Runs a definition; `invoke(function, payload) -> result` is the Lambda call."""

    def __init__(self, definition: dict, substitutions: dict, invoke, max_parallel: int = 4):
        self.definition, self.subs, self.invoke, self.max_parallel = definition, substitutions, invoke, max_parallel
        self.transitions = 0

    def run(self, doc):
        return self._run(self.definition, doc)

    def _run(self, machine: dict, doc):
        name = machine["StartAt"]
        while True:
            state = machine["States"][name]
            self.transitions += 1
            kind = state["Type"]
            if kind == "Task":
                doc = self._task(state, doc)
            elif kind == "Parallel":
                with ThreadPoolExecutor(max_workers=self.max_parallel) as pool:
                    results = list(pool.map(lambda b: self._run(b, doc), state["Branches"]))  # noqa: B023 (called within this iteration)
                doc = self._result(state, doc, results)
            elif kind == "Choice":
                nxt = state.get("Default")
                for rule in state["Choices"]:
                    if _matches(rule, doc):
                        nxt = rule["Next"]
                        break
                if nxt is None:
                    raise ASLError(f"choice state {name!r} matched nothing and has no Default")
                name = nxt
                continue
            elif kind == "Succeed":
                return doc
            elif kind != "Pass":
                raise ASLError(f"unsupported state type {kind!r}")
            if len(json.dumps(doc)) > STATE_LIMIT_BYTES:
                raise ASLError(f"state after {name!r} exceeds Step Functions' {STATE_LIMIT_BYTES} byte limit")
            if state.get("End"):
                return doc
            name = state["Next"]

    def _task(self, state: dict, doc):
        doc = self._task_result(state, doc)
        if "OutputPath" in state:
            try:
                doc = path_get(doc, state["OutputPath"])
            except (KeyError, TypeError):
                raise ASLError(f"OutputPath {state['OutputPath']!r} selects nothing") from None
        return doc

    def _task_result(self, state: dict, doc):
        if state.get("Resource") != "arn:aws:states:::lambda:invoke":
            raise ASLError(f"unsupported task resource {state.get('Resource')!r}")
        params = render(state["Parameters"], doc)
        fn = params["FunctionName"]
        if fn.startswith("${") and fn.endswith("}"):
            fn = self.subs[fn[2:-1]]
        result = {"Payload": self.invoke(fn, params.get("Payload", {}))}
        if "ResultSelector" in state:
            result = render(state["ResultSelector"], result)
        return self._result(state, doc, result)

    @staticmethod
    def _result(state: dict, doc, result):
        path = state.get("ResultPath", "$")
        if path is None:
            return doc
        if path == "$":
            return result
        raise ASLError(f"unsupported ResultPath {path!r}")
